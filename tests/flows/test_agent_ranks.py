"""`longstraw train --nproc 2` with an agent (gloo, torchrun): one sequence-parallel group of 2 ranks (only its
rank 0 makes and calls the environments, and broadcasts their replies), or 2 data-parallel groups (each samples
its slice of the branches with its own environments; rank 0 gathers their turns and stores them). Both equal a
1-rank run: the same stored branches, masks, turns and environment rewards, each tool call made once, and the
final weights within 1e-6 (float64, as tests/flows/test_ranks.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from longstraw.store import load_rollout
from tests import progress
from tests.flows.agent_user import agent_config, write_module
from tests.flows.test_agent_train import _timeless

ROOT = Path(__file__).resolve().parents[2]


def _train(tmp_path: Path, name: str, **kw) -> Path:
    """`longstraw train` of the agent run `name` in a subprocess (the user's module on PYTHONPATH, scripted), its
    tool calls counted in <name>-calls.txt."""
    user = tmp_path / "user"
    if not user.exists():
        write_module(user)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(agent_config(tmp_path / name, dtype="float64", threads=1, **kw)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user), str(ROOT)]), "AGENT_TEST_SCRIPTED": "1",
           "AGENT_TEST_CALLS": str(tmp_path / f"{name}-calls.txt")}
    env.pop("AGENT_TEST_KILL_AT", None)
    nproc = kw.get("pipeline", {}).get("nproc", 1)
    done = progress.run([sys.executable, "-m", "flows.cli", "train", "--config", str(path), "--nproc", str(nproc),
                         "--no-progress"], cwd=ROOT, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return tmp_path / name


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("agent-one"), "one")


@pytest.mark.parametrize("sp", [2, 1], ids=["one-sp-group", "two-dp-groups"])
def test_two_ranks_equal_one_rank(tmp_path, one_rank, sp):
    two = _train(tmp_path, "two", pipeline={"nproc": 2, "sp": sp, "branches_per_task": 2, "retries": 0})
    for step in range(2):
        want = load_rollout(str(one_rank / "store" / "rollouts" / f"step-{step:06d}" / "group-000"))
        got = load_rollout(str(two / "store" / "rollouts" / f"step-{step:06d}" / "group-000"))
        assert got.masks is not None and any(not m.all() for m in got.masks)
        for a, b, ma, mb in zip(got.responses, want.responses, got.masks, want.masks, strict=True):
            assert torch.equal(a, b) and torch.equal(ma, mb)
        assert _timeless(got.meta["agent"]) == _timeless(want.meta["agent"])
        assert got.meta["finish_reasons"] == want.meta["finish_reasons"]
    # every tool call made once: by rank 0 of each sequence-parallel group, never by the other rank
    calls = (two.parent / "two-calls.txt").read_text().split()
    assert sorted(calls) == sorted((one_rank.parent / "one-calls.txt").read_text().split()) and calls
    got = load_file(str(two / "checkpoints" / "update-000002" / "model.safetensors"))
    want = load_file(str(one_rank / "checkpoints" / "update-000002" / "model.safetensors"))
    start = load_file(str(one_rank / "checkpoints" / "update-000000" / "model.safetensors"))
    assert got.keys() == want.keys() and any(not torch.equal(start[k], want[k]) for k in want)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert diff <= 1e-6, diff
