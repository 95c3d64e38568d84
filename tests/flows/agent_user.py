"""What the agent pipeline tests (tests/flows/test_agent_*.py) share: a user's environment and tool, written as a
module into a temporary directory (as a user's own module on PYTHONPATH), and the run config that names it.

A tiny random model writes no valid tool call and ends a turn (its end-of-sequence id) about once in 260 tokens,
so the module can script both: `script(patch)` makes every turn of the model one call (of `count`, or of an
unknown tool every third turn, an error observation) and its control bytes end turns, as a model taught the call
format would. The tests apply it with pytest's monkeypatch; a subprocess (a killed run, torchrun's ranks) applies
it when the module is imported with AGENT_TEST_SCRIPTED=1 in its environment.

The tool `count(n)` appends n to the file $AGENT_TEST_CALLS (one line per call); when that file has reached
$AGENT_TEST_KILL_AT lines it kills its process group at once (SIGKILL: a kill in the middle of the rollout's
tool calls).
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import tiny_config

MODULE = "agent_user_env"

SOURCE = '''
"""A user's agent environment and tool (tests/flows/agent_user.py)."""
import dataclasses
import os
import signal

from longstraw.agents import Feedback, ToolCall, ToolChat, ToolRegistry

tools = ToolRegistry()


@tools.register
def count(n: int) -> str:
    """Counts its calls: n times 7."""
    path = os.environ.get("AGENT_TEST_CALLS")
    if path:
        with open(path, "a") as f:
            f.write(f"{n}\\n")
        with open(path) as f:
            calls = sum(1 for _ in f)
        if calls >= int(os.environ.get("AGENT_TEST_KILL_AT") or 10**9):
            os.killpg(os.getpgrp(), signal.SIGKILL)
    return str(7 * n)


class Counter:
    """Turn 1: the tool's result answers it; turn 2 ends the branch with reward len(text) / 100."""

    def __init__(self, example):
        assert {"prompt", "answer", "meta"} <= set(example), sorted(example)
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        if self.turns >= 2:
            return Feedback(done=True, reward=len(turn.text) / 100)
        return Feedback(reward=0.0)


def make_env(example):
    return Counter(example)


def scripted_calls(self, text):
    """Stands for a model that calls a tool in every turn."""
    return [ToolCall("count", {"n": len(text)})] if len(text) % 3 else [ToolCall("missing", {})]


def script(patch):
    """patch(obj, name, value): the scripted calls and turn ends (see tests/flows/agent_user.py)."""
    import longstraw.train.worker as worker

    sampling = worker.Worker._sampling

    def with_control_stops(self, eos_id):
        settings = sampling(self, eos_id)
        return dataclasses.replace(settings, stop_ids=(*settings.stop_ids, *range(32)))

    patch(ToolChat, "parse", scripted_calls)
    patch(worker.Worker, "_sampling", with_control_stops)


if os.environ.get("AGENT_TEST_SCRIPTED"):
    script(setattr)
'''


def write_module(directory: Path) -> Path:
    """The user's module in `directory` (which the test puts on sys.path / PYTHONPATH)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{MODULE}.py"
    path.write_text(SOURCE)
    return path


def agent_config(run_dir, **kw) -> dict:
    """A small agent run: the user's environment, the tiny random model, 2 steps of 1 group of 4 branches."""
    from longstraw.train.config import TrainConfig

    model = tiny_config("qwen3", vocab_size=260, max_position_embeddings=1024, num_hidden_layers=2)
    base = dict(model={"random": model}, prompt_tokens=256, steps=2, groups=1, responses=4, max_new_tokens=80,
                agent={"env": f"{MODULE}:make_env", "max_turns": 3, "tool_timeout": 60.0},
                engine={"prompt_chunk": 128}, run_dir=str(run_dir), optim={"lr": 1e-2},
                pipeline={"branches_per_task": 2, "retries": 0})
    return TrainConfig.model_validate(base | kw).model_dump(mode="json")
