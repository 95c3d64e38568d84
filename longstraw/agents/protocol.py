"""The multi-turn rollout's view of an environment: token ids in, token ids out, one object per branch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class TurnReply:
    """What follows a branch's turn: `tokens` the model did not write (a tool's result rendered with the chat
    format, ending with the next assistant header; may be empty), appended to the branch, and whether the branch
    is `done` (no further turn)."""

    tokens: list[int]
    done: bool


@runtime_checkable
class TurnEnv(Protocol):
    """One branch's environment, as the rollout sees it. `step` gets the token ids the model wrote in the turn that
    just ended (its stop id included) and answers with what follows them."""

    def step(self, tokens: list[int]) -> TurnReply: ...
