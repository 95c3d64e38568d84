"""`longstraw train` with an agent (`agent: {env: module:function}`) on one process: a user's environment and tool
from their own module; the rollout stores each branch's mask and turns (text, tool calls, results, observation),
the environments' rewards and counters; the reward `env` reads those rewards; the masks reach the loss; MLflow
gets turns, tool calls, tool errors and tool time per step. And a kill in the middle of the rollout's tool calls:
`longstraw resume` reuses the finished rollout (its tools are not called again), redoes the partial one and ends
with the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import longstraw.train.worker as worker_module
from flows.cli import main
from flows.train import grpo_train
from longstraw.data import load_tokenizer
from longstraw.engine import Branches
from longstraw.store import load_rollout
from tests.flows.agent_user import MODULE, agent_config, write_module

ROOT = Path(__file__).resolve().parents[2]
STOPS = set(range(32)) | {load_tokenizer("byte").eos_id}  # the scripted turn ends (agent_user.py)


@pytest.fixture
def user(tmp_path, monkeypatch):
    """The user's module importable, scripted (agent_user.py), its tool counting calls in a file."""
    write_module(tmp_path / "user")
    monkeypatch.syspath_prepend(str(tmp_path / "user"))
    sys.modules.pop(MODULE, None)
    import importlib

    module = importlib.import_module(MODULE)
    module.script(monkeypatch.setattr)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("AGENT_TEST_CALLS", str(calls))
    monkeypatch.delenv("AGENT_TEST_KILL_AT", raising=False)
    yield calls
    sys.modules.pop(MODULE, None)


def _rollout(run_dir: Path, step: int, group: int = 0):
    return load_rollout(str(run_dir / "store" / "rollouts" / f"step-{step:06d}" / f"group-{group:03d}"))


def _tool_lines(path: Path) -> int:
    return len(path.read_text().split()) if path.exists() else 0


def test_agent_run_stores_turns_masks_env_rewards_and_metrics(tmp_path, user, monkeypatch):
    masks_seen = []
    group = Branches.group

    def spying(*a, **kw):  # the masks the replay hands the loss
        masks_seen.append(kw.get("masks"))
        return group(*a, **kw)

    monkeypatch.setattr(worker_module.Branches, "group", spying)
    run_dir = tmp_path / "run"
    grpo_train(agent_config(run_dir), progress=False)
    tok = load_tokenizer("byte")
    invoked = 0
    for step in range(2):
        got = _rollout(run_dir, step)
        agent = got.meta["agent"]
        assert got.masks is not None and len(got.masks) == 4
        rewards = json.loads((run_dir / "steps" / f"step-{step:06d}" / "rewards-g000.json").read_text())
        for i, (tokens, mask, turns) in enumerate(zip(got.responses, got.masks, agent["branches"], strict=True)):
            assert mask.dtype == torch.bool and mask.shape == tokens.shape
            # the model's turns: runs of its tokens, each ended by a stop id (or the budget)
            model_turns, current = [], []
            for t, wrote in zip(tokens.tolist(), mask.tolist()):
                if wrote:
                    current.append(t)
                    if t in STOPS:
                        model_turns.append(current)
                        current = []
            assert agent["turns"][i] == len(model_turns) + bool(current)
            # every turn the model ended with a stop id went to the environment (which ends the branch at turn 2)
            assert len(turns) == len(model_turns) <= 2
            for turn, written in zip(turns, model_turns):
                assert turn["text"] == tok.decode(written)
                n = len(turn["text"])
                if n % 3:  # the scripted call of count(n) and its result, which the observation shows
                    assert turn["calls"] == [{"name": "count", "arguments": {"n": n}, "error": None}]
                    assert turn["results"][0]["content"] == str(7 * n) and not turn["results"][0]["error"]
                else:
                    assert turn["calls"][0]["name"] == "missing" and turn["results"][0]["error"]
                    assert "unknown tool 'missing'" in turn["results"][0]["content"]
            if got.meta["finish_reasons"][i] == "stop":  # the environment ended it: no observation was cut
                assert turns[0]["results"][0]["content"] in turns[0]["observation"] and turns[1]["observation"] == ""
            # the observation tokens are exactly the ones not written by the model
            assert "".join(t["observation"] for t in turns) == tok.decode(tokens[~mask].tolist())
            assert agent["tool_calls"][i] == len(turns)
            assert agent["tool_errors"][i] == sum(len(t["text"]) % 3 == 0 for t in turns)
            invoked += sum(len(t["text"]) % 3 != 0 for t in turns)
            # the environment's reward: 0 after turn 1, len(text) / 100 at turn 2, None when it saw no turn
            want = None if not turns else 0.0 if len(turns) == 1 else len(turns[1]["text"]) / 100
            assert agent["rewards"][i] == want
            assert rewards["rewards_per_function"]["env"][i] == want and rewards["rewards"][i] == want
        assert any(not m.all() for m in got.masks) and any(len(b) == 2 for b in agent["branches"])
        hist = json.loads((run_dir / "history.json").read_text())[step]
        assert hist["turns_per_branch"] == sum(agent["turns"]) / 4
        assert hist["tool_calls"] == sum(agent["tool_calls"]) and hist["tool_errors"] == sum(agent["tool_errors"])
        assert hist["tool_seconds"] == pytest.approx(sum(agent["tool_seconds"])) and hist["tool_seconds"] > 0
        assert 0 < hist["env_seconds"] <= hist["rollout_seconds"]
    assert _tool_lines(user) == invoked > 0  # the tool ran once per call of it, no more
    # every replay handed the loss the rollout's masks
    assert masks_seen and all(m is not None and len(m) == 4 for m in masks_seen)
    assert all(torch.equal(a, b) for a, b in zip(masks_seen[-1], _rollout(run_dir, 1).masks))

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    parent = client.search_runs([client.get_experiment_by_name("longstraw").experiment_id], "tags.run_dir != ''")[0]
    for key in ("turns_per_branch", "tool_calls", "tool_errors", "tool_seconds", "env_seconds", "rewards/env/mean"):
        assert len(client.get_metric_history(parent.info.run_id, key)) == 2, key


def test_env_reward_combines_with_another_reward(tmp_path, user):
    run_dir = tmp_path / "run"
    grpo_train(agent_config(run_dir, steps=1, reward=["env", "tests.flows.rewards:digit_share"],
                            grpo={"reward_weights": [1.0, 0.5]}), progress=False)
    from tests.flows.rewards import digit_share

    got = _rollout(run_dir, 0)
    record = json.loads((run_dir / "steps" / "step-000000" / "rewards-g000.json").read_text())
    for i, text in enumerate(got.meta["texts"]):
        env = got.meta["agent"]["rewards"][i]
        assert record["rewards_per_function"]["env"][i] == env
        assert record["rewards_per_function"]["tests.flows.rewards:digit_share"][i] == pytest.approx(
            digit_share({}, text))
        if env is not None:
            assert record["rewards"][i] == pytest.approx(env + 0.5 * digit_share({}, text))


# --- a kill during the rollout's tool calls, then resume ---------------------------------------------------------

KILLED_TRAIN = """
import sys
from flows.cli import main
sys.exit(main(["train", "--config", sys.argv[1], "--no-progress"]))
"""


def _timeless(agent: dict) -> dict:
    """An agent's rollout meta without the tools' times (which differ from run to run)."""
    branches = [[{**t, "results": [{k: v for k, v in r.items() if k != "seconds"} for r in t["results"]]}
                 for t in turns] for turns in agent["branches"]]
    return {**{k: v for k, v in agent.items() if k != "tool_seconds"}, "branches": branches}


def test_kill_during_tool_calls_then_resume(tmp_path, user, monkeypatch):
    import yaml

    kw = dict(steps=1, groups=2)
    clean = tmp_path / "clean"
    grpo_train(agent_config(clean, **kw), progress=False)
    invoked = [sum(c - e for c, e in zip(_rollout(clean, 0, g).meta["agent"]["tool_calls"],
                                         _rollout(clean, 0, g).meta["agent"]["tool_errors"])) for g in range(2)]
    assert invoked[0] > 0 and invoked[1] >= 2, invoked
    assert _tool_lines(user) == sum(invoked)

    run_dir = tmp_path / "run"
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(agent_config(run_dir, **kw)))
    calls = tmp_path / "killed-calls.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "user"), str(ROOT)]),
           "AGENT_TEST_SCRIPTED": "1", "AGENT_TEST_CALLS": str(calls), "AGENT_TEST_KILL_AT": str(invoked[0] + 2)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_TRAIN, str(path)], cwd=ROOT, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, output.decode()[-3000:]
    at_kill = _tool_lines(calls)
    assert at_kill >= invoked[0] + 2
    finished = _rollout(run_dir, 0, 0)  # group 0's rollout was stored before the kill
    assert not (run_dir / "store" / "rollouts" / "step-000000" / "group-001" / "manifest.json").exists()
    assert not (run_dir / "checkpoints" / "update-000001").exists()

    monkeypatch.setenv("AGENT_TEST_CALLS", str(calls))
    assert main(["resume", str(run_dir), "--no-progress"]) == 0
    # group 0's rollout was reused (none of its tools ran again), group 1's redone from its start
    assert _tool_lines(calls) == at_kill + invoked[1]
    assert _rollout(run_dir, 0, 0).meta == finished.meta
    for g in range(2):
        assert _timeless(_rollout(run_dir, 0, g).meta["agent"]) == _timeless(_rollout(clean, 0, g).meta["agent"])
    got = load_file(str(run_dir / "checkpoints" / "update-000001" / "model.safetensors"))
    want = load_file(str(clean / "checkpoints" / "update-000001" / "model.safetensors"))
    start = load_file(str(clean / "checkpoints" / "update-000000" / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(start[k], want[k]) for k in want)
