"""`ToolTurns`: a `TurnEnv` over a user's `Environment`, tools and a tokenizer.

Each turn: the model's tokens are decoded to text, the tool calls in it parsed and run, the environment told the
turn and its results, and its feedback rendered with the chat template into the tokens that follow the turn.
`step_branches` does this for many branches at once, their tool calls run together.
"""

from __future__ import annotations

from collections.abc import Sequence

from .chat import ToolChat
from .environment import Environment, EnvironmentFailed, Feedback, Turn
from .protocol import TurnReply
from .tools import ToolCall, ToolResult, ToolRunner


class ToolTurns:
    """One branch: its environment, with the chat format and tool runner that all branches share.

    After the rollout: `reward` (the last one the environment gave; None if it never gave one), `turns`,
    `tool_calls`, `tool_errors`, `tool_seconds` and `history` (every `Turn`, for storing and inspection).
    """

    def __init__(self, env: Environment, chat: ToolChat, runner: ToolRunner | None = None, *,
                 name: str | None = None):
        if not callable(getattr(env, "step", None)):
            raise TypeError(f"{type(env).__name__} has no step(turn) method; an environment answers each turn "
                            f"with step(turn: Turn) -> Feedback")
        self.env, self.chat = env, chat
        self.runner = runner if runner is not None else ToolRunner(chat.registry)
        self.name = name or type(env).__qualname__
        self.reward: float | None = None
        self.done = False
        self.turns = self.tool_calls = self.tool_errors = 0
        self.tool_seconds = 0.0
        self.history: list[Turn] = []

    def step(self, tokens: list[int]) -> TurnReply:
        return step_branches([self], [tokens])[0]

    def _parse(self, tokens: list[int]) -> tuple[str, list[ToolCall]]:
        if self.done:
            raise RuntimeError(f"environment {self.name}: step() after the branch is done")
        text = self.chat.tokenizer.decode(tokens)
        return text, self.chat.parse(text)

    def _finish(self, text: str, calls: list[ToolCall], results: list[ToolResult]) -> TurnReply:
        turn = Turn(text, tuple(calls), tuple(results))
        self.turns += 1
        self.tool_calls += len(calls)
        self.tool_errors += sum(r.error for r in results)
        self.tool_seconds += sum(r.seconds for r in results)
        self.history.append(turn)
        try:
            feedback = self.env.step(turn)
        except Exception as e:
            raise EnvironmentFailed(f"environment {self.name} raised {type(e).__name__} on turn {self.turns}: "
                                    f"{e}") from e
        if not isinstance(feedback, Feedback):
            raise EnvironmentFailed(f"environment {self.name} returned a {type(feedback).__name__} on turn "
                                    f"{self.turns}; step() must return a Feedback")
        if feedback.reward is not None:
            self.reward = float(feedback.reward)
        observation = feedback.observation
        if feedback.done or (not calls and observation is None):
            self.done = True
            return TurnReply([], True)
        if isinstance(observation, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in observation):
                raise EnvironmentFailed(f"environment {self.name}: a token observation must be a list of ints")
            return TurnReply(list(observation), False)
        if observation is not None and not isinstance(observation, str):
            raise EnvironmentFailed(f"environment {self.name}: observation must be text, token ids or None, got "
                                    f"{type(observation).__name__}")
        return TurnReply(self.chat.observation(results, observation, feedback.role), False)


def step_branches(branches: Sequence[ToolTurns], tokens: Sequence[list[int]]) -> list[TurnReply]:
    """`branch.step(tokens)` for every branch, the tool calls of all of them run concurrently (per runner)."""
    if len(branches) != len(tokens):
        raise ValueError(f"step_branches: {len(branches)} branches but {len(tokens)} token lists")
    parsed = [b._parse(t) for b, t in zip(branches, tokens)]
    results: list[list[ToolResult]] = [[] for _ in branches]
    by_runner: dict[int, list[int]] = {}
    for i, b in enumerate(branches):
        by_runner.setdefault(id(b.runner), []).append(i)
    for indices in by_runner.values():
        ran = branches[indices[0]].runner.run([parsed[i][1] for i in indices])
        for i, r in zip(indices, ran):
            results[i] = r
    return [b._finish(text, calls, r) for b, (text, calls), r in zip(branches, parsed, results)]
