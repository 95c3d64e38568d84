"""The environment protocol: factories named "module:function", and an environment that fails is one clear error
naming it."""

from __future__ import annotations

import sys

import pytest

from longstraw.agents import (EnvironmentFailed, Feedback, ToolChat, ToolRegistry, ToolTurns, Turn,
                              load_environment_factory, make_environment)
from longstraw.data.tokenizer import ByteTokenizer


class Echo:
    def __init__(self, example: dict):
        self.answer = example["answer"]

    def step(self, turn: Turn) -> Feedback:
        return Feedback(done=True, reward=float(self.answer in turn.text))


def make_echo(example: dict) -> Echo:
    return Echo(example)


def broken_factory(example: dict) -> Echo:
    raise KeyError("answer")


NOT_A_FUNCTION = 3


def test_load_factory():
    assert load_environment_factory(f"{__name__}:make_echo") is make_echo
    env = make_environment(f"{__name__}:make_echo", {"answer": "42"})
    assert env.step(Turn("it is 42")) == Feedback(done=True, reward=1.0)


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "must be 'module:function'"),
    ("module:", "must be 'module:function'"),
    ("longstraw_no_such_module:make", "no module named 'longstraw_no_such_module'"),
    ("longstraw.agents.no_such:make", "no module named 'longstraw.agents.no_such'"),
    (f"{__name__}:make_ecko", "has no attribute 'make_ecko'"),
    (f"{__name__}:NOT_A_FUNCTION", "is a int, not a function"),
])
def test_load_factory_errors(spec, message):
    with pytest.raises(ValueError) as e:
        load_environment_factory(spec)
    assert message in str(e.value) and spec in str(e.value)
    assert "\n" not in str(e.value)


def test_module_failing_its_own_import_is_told_apart(tmp_path, monkeypatch):
    (tmp_path / "env_with_bad_import.py").write_text("import longstraw_missing_dependency\ndef make(e): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as e:
        load_environment_factory("env_with_bad_import:make")
    assert "importing 'env_with_bad_import' failed" in str(e.value) and "longstraw_missing_dependency" in str(e.value)
    sys.modules.pop("env_with_bad_import", None)


def test_factory_failures_name_it():
    with pytest.raises(EnvironmentFailed, match="broken_factory raised KeyError"):
        make_environment(broken_factory, {})
    with pytest.raises(EnvironmentFailed, match="has no step"):
        make_environment(lambda example: object(), {})


def test_environment_that_raises_is_one_clear_error():
    class Flaky:
        def step(self, turn: Turn) -> Feedback:
            raise ZeroDivisionError("division by zero in the grader")

    tools = ToolRegistry()
    tools.register(lambda key: key, name="lookup", description="Look up.",
                   parameters={"type": "object", "properties": {"key": {"type": "string"}}})
    branch = ToolTurns(Flaky(), ToolChat(ByteTokenizer(), tools), name="my_envs:make_flaky")
    with pytest.raises(EnvironmentFailed) as e:
        branch.step(list(b"hello") + [ByteTokenizer.EOS])
    assert str(e.value) == ("environment my_envs:make_flaky raised ZeroDivisionError on turn 1: division by zero in "
                            "the grader")

    class WrongAnswer:
        def step(self, turn: Turn):
            return {"done": True}

    with pytest.raises(EnvironmentFailed, match="returned a dict on turn 1; step\\(\\) must return a Feedback"):
        ToolTurns(WrongAnswer(), ToolChat(ByteTokenizer(), tools)).step(list(b"hi"))
