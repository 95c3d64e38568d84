"""The user's environment: made from one dataset example, it reads each turn the model wrote (and the results of
the tools it called) and answers with feedback: an observation, whether the branch is done, and a reward.

A user writes `def make_env(example: dict) -> Environment` in their own module and names it "module:function".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..named import load_named
from .tools import ToolCall, ToolResult


@dataclass(frozen=True)
class Turn:
    """One turn of one branch: the text the model wrote (special tokens dropped), the tool calls parsed from it and
    their results (one per call, in order; errors included)."""

    text: str
    calls: tuple[ToolCall, ...] = ()
    results: tuple[ToolResult, ...] = ()


@dataclass(frozen=True)
class Feedback:
    """The environment's answer to a turn.

    `observation`: None (the tool results alone answer the turn), text (a message of role `role`, rendered with
    the chat template after the tool results), or token ids (appended as they are, in place of any rendering: the
    environment then writes the tool results and the next assistant header itself).
    `done`: no further turn. A turn without a tool call that gets no observation ends the branch too: nothing
    would answer it.
    `reward`: the branch's reward so far; the last one given is the branch's reward (so a branch cut short by its
    token budget keeps the reward of its last feedback).
    """

    observation: str | list[int] | None = None
    done: bool = False
    reward: float | None = None
    role: str = "user"


@runtime_checkable
class Environment(Protocol):
    """One branch's environment."""

    def step(self, turn: Turn) -> Feedback: ...


EnvironmentFactory = Callable[[dict], Environment]


class EnvironmentFailed(RuntimeError):
    """The user's environment (or its factory) raised: the run stops with this one error naming it."""


def load_environment_factory(spec: str) -> EnvironmentFactory:
    """The function named by "module:function" (e.g. "my_envs.search:make_env")."""
    return load_named(spec, "environment", "my_envs.search:make_env", "make_env(example: dict) -> Environment")


def make_environment(factory: EnvironmentFactory | str, example: dict) -> Environment:
    """The environment of one branch, made from its dataset example."""
    if isinstance(factory, str):
        factory = load_environment_factory(factory)
    name = getattr(factory, "__qualname__", repr(factory))
    try:
        env = factory(example)
    except Exception as e:
        raise EnvironmentFailed(f"environment factory {name} raised {type(e).__name__}: {e}") from e
    if not callable(getattr(env, "step", None)):
        raise EnvironmentFailed(f"environment factory {name} returned a {type(env).__name__}, which has no "
                                f"step(turn) method; return an object with step(turn: Turn) -> Feedback")
    return env
