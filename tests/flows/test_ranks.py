"""`longstraw train --nproc 2` end to end: two gloo ranks under torchrun keep the model resident for the run, rank 0
drives them through the Prefect flow. A fault in one rank's replay of step 1 ends the job with that rank's error;
`longstraw resume` finishes it with weights bitwise equal to an uninterrupted 2-rank run and within 1e-6 of a
1-rank run (float64: at float32 AdamW turns the rounding of near-zero gradients into larger weight differences),
and every rank loads the model once per worker start. The faults and counters come from tests/flows/hooks
(sitecustomize), outside the library."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from tests import progress
from tests.flows.test_train_flow import config

ROOT = Path(__file__).resolve().parents[2]
HOOKS = Path(__file__).parent / "hooks"


def _env(**env) -> dict[str, str]:
    """The environment of a `longstraw` command under test: the test hooks loaded, and `env`."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOKS), str(ROOT)]), **env}


def _cli(args: list[str], tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """Run `longstraw ARGS` to its end; fails only on a hang (tests/progress.py), never on a slow machine."""
    return progress.run([sys.executable, "-m", "flows.cli", *args, "--no-progress"], cwd=ROOT, env=_env(**env))


def _yaml(tmp_path: Path, name: str) -> Path:
    cfg = config(tmp_path / name, dtype="float64", threads=1)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _final(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(tmp_path / name / "checkpoints" / "update-000002" / "model.safetensors"))


def _counts(d: Path) -> dict[str, list[str]]:
    return {p.stem: p.read_text().split() for p in sorted(d.glob("rank*.txt"))}


def test_two_ranks_fault_in_one_rank_then_resume(tmp_path):
    counts = tmp_path / "counts"
    counts.mkdir()
    run = _yaml(tmp_path, "run")
    failed = _cli(["train", "--config", str(run), "--nproc", "2"], tmp_path, LONGSTRAW_TEST_FAULT="replay:1:1",
                  LONGSTRAW_TEST_COUNTS=str(counts))
    out = failed.stdout + failed.stderr
    assert failed.returncode != 0, out[-3000:]
    assert "rank 1 of 2 failed in replay (step 1" in out and "injected replay fault on rank 1" in out, out[-3000:]
    # torchrun's own report is one line (longstraw/parallel/agent.py), not its traceback and box
    assert "torchrun: rank 0 (pid" in out and "ChildFailedError" not in out and "Root Cause" not in out, out[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "update-000001").is_dir()  # step 0 committed
    assert not (tmp_path / "run" / "checkpoints" / "update-000002").exists()
    # every rank: one worker start, one model load
    assert _counts(counts) == {"rank0": ["start", "load"], "rank1": ["start", "load"]}, _counts(counts)

    for f in counts.iterdir():
        f.unlink()
    resumed = _cli(["resume", str(tmp_path / "run"), "--nproc", "2"], tmp_path, LONGSTRAW_TEST_COUNTS=str(counts))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert _counts(counts) == {"rank0": ["start", "load"], "rank1": ["start", "load"]}, _counts(counts)
    state = tmp_path / "run" / "store" / "states" / "step-000001" / "group-000" / "epoch-00"
    assert sorted(p.name for p in state.iterdir()) == ["manifest.json", "shard-000", "shard-001"]

    clean = _cli(["train", "--config", str(_yaml(tmp_path, "clean")), "--nproc", "2"], tmp_path)
    assert clean.returncode == 0, (clean.stdout + clean.stderr)[-3000:]
    one = _cli(["train", "--config", str(_yaml(tmp_path, "one"))], tmp_path)
    assert one.returncode == 0, (one.stdout + one.stderr)[-3000:]

    got, want, single = _final(tmp_path, "run"), _final(tmp_path, "clean"), _final(tmp_path, "one")
    start = load_file(str(tmp_path / "run" / "checkpoints" / "update-000000" / "model.safetensors"))
    assert got.keys() == want.keys() == single.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)  # bitwise: the resumed run is the uninterrupted one
    assert any(not torch.equal(start[k], want[k]) for k in want)  # and training moved the weights
    diff = max(float((got[k] - single[k]).abs().max()) for k in want)
    assert diff <= 1e-6, diff


def _fail_then_resume(tmp_path: Path, config_path: Path, run_dir: Path) -> None:
    """A ZeRO-3 run on 2 ranks that fails in rank 1's replay of step 1, then `longstraw resume`: the resumed
    worker start reads the checkpoint's weights on rank 0 only (rank 1 builds the model on the meta device and
    takes its shards by broadcast)."""
    counts = tmp_path / f"counts-{run_dir.name}"
    counts.mkdir()
    failed = _cli(["train", "--config", str(config_path)], tmp_path, LONGSTRAW_TEST_FAULT="replay:1:1")
    assert failed.returncode != 0 and "injected replay fault on rank 1" in failed.stdout + failed.stderr
    resumed = _cli(["resume", str(run_dir)], tmp_path, LONGSTRAW_TEST_COUNTS=str(counts))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert _counts(counts) == {"rank0": ["start", "load"], "rank1": ["start"]}, _counts(counts)


def test_two_data_parallel_groups_under_zero3_match_one_rank(tmp_path):
    """nproc 2, sp 1: two data-parallel groups, each holding the whole prefix state and replaying half of the
    branches, parameters and moments sharded by FSDP (ZeRO-3); the sharded checkpoint's HF export equals a 1-rank
    run's weights within 1e-6, and each rank wrote its own share of the AdamW state. The run fails once and is
    resumed, with the weights read by rank 0 alone."""
    cfg = config(tmp_path / "dp", dtype="float64", threads=1, pipeline={"nproc": 2, "sp": 1, "retries": 0},
                 optim={"lr": 1e-2, "zero_stage": 3})
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    _fail_then_resume(tmp_path, path, tmp_path / "dp")
    one = _cli(["train", "--config", str(_yaml(tmp_path, "one"))], tmp_path)
    assert one.returncode == 0, (one.stdout + one.stderr)[-3000:]
    got, single = _final(tmp_path, "dp"), _final(tmp_path, "one")
    assert got.keys() == single.keys()
    diff = max(float((got[k] - single[k]).abs().max()) for k in single)
    assert diff <= 1e-6, diff
    shards = sorted((tmp_path / "dp" / "checkpoints" / "update-000002" / "trainer" / "optimizer").iterdir())
    assert len(shards) == 2  # one per rank


def test_nproc_on_the_command_line_applies_before_validation(tmp_path):
    """A ZeRO-3 config needs several ranks: `--nproc 2` makes it valid; without it the error names the fix."""
    import argparse

    import pytest

    from flows.cli import _config

    cfg = config(tmp_path / "z", pipeline={"nproc": 2, "retries": 0}, optim={"zero_stage": 3})
    cfg["pipeline"]["nproc"] = 1
    path = tmp_path / "z.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = argparse.Namespace(config=str(path), run_dir=None, steps=None, nproc=2)
    assert _config(args).pipeline.nproc == 2
    with pytest.raises(ValueError, match="zero_stage 3 shards over several ranks; set pipeline.nproc > 1"):
        _config(argparse.Namespace(config=str(path), run_dir=None, steps=None, nproc=None))


def test_lora_under_zero3_on_two_ranks_matches_one_rank(tmp_path):
    """LoRA with a KL term and the frozen base weights sharded by FSDP (ZeRO-3) on 2 ranks, failed once and resumed:
    the adapter after 2 steps is within 1e-6 of a 1-rank LoRA run's, and the base weights are written once, at
    update 0."""
    lora = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    runs = {}
    for name, extra in (("z3", dict(pipeline={"nproc": 2, "retries": 0}, optim={"lr": 1e-2, "zero_stage": 3})),
                        ("single", {})):
        # with a KL term: the reference (update 0's base weights) is loaded the sharded way too under ZeRO-3
        cfg = config(tmp_path / name, dtype="float64", threads=1, lora=lora,
                     grpo={"kl_coef": 0.05}, **extra)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        if name == "z3":  # resumed: rank 0 alone reads the base weights and the adapter
            _fail_then_resume(tmp_path, path, tmp_path / name)
        else:
            done = _cli(["train", "--config", str(path)], tmp_path)
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        final = tmp_path / name / "checkpoints" / "update-000002"
        assert not (final / "model.safetensors").exists()
        runs[name] = load_file(str(final / "adapter_model.safetensors"))
    assert runs["z3"].keys() == runs["single"].keys()
    diff = max(float((runs["z3"][k] - runs["single"][k]).abs().max()) for k in runs["single"])
    assert diff <= 1e-6, diff
