"""An agent's rollout on the worker (`TrainConfig.agent`, docs/agents.md): the environments of a group's branches,
their multi-turn decode on the captured prompt, and the record stored with the rollout.

Each branch gets its own environment, made from the group's example (`env_example`) by the factory that
`agents.builtin.resolve_environment` names, wrapped in a `ToolTurns` with the run's tools. Only rank 0 of a
sequence-parallel group makes and calls them (`rollout_turns` broadcasts their replies); the other ranks pass
placeholders that are never called. What the environments said (each turn's text, tool calls and results, the
rewards, the counters) is JSON, gathered over the data-parallel groups like the samples and stored in the
rollout's meta under "agent": a resume reads it back and never calls the tools again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from torch import nn

from ..agents import (EnvironmentFailed, ToolChat, ToolRunner, ToolTurns, Turn, make_environment,
                      rollout_turns)
from ..agents.builtin import resolve_environment
from ..data import Tokenizer
from ..parallel import SequenceGroup
from ..rollout import Sample
from ..sampler import Draw, SamplingSettings
from ..state import PrefixState
from .config import AgentConfig

COUNTERS = ("tool_calls", "tool_errors", "tool_seconds")


class TimedEnv:
    """An env whose replies are timed: the intervals the decode waited on it (envs of one step run together)."""

    def __init__(self, env: ToolTurns, spans: list[tuple[float, float]], lock: threading.Lock):
        self.env, self.spans, self.lock = env, spans, lock

    def step(self, tokens: list[int]):
        t0 = time.perf_counter()
        try:
            return self.env.step(tokens)
        finally:
            with self.lock:
                self.spans.append((t0, time.perf_counter()))


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of the intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class AgentRollout:
    """The run's environment factory, tools and chat format, resolved once per worker; `sample` runs one group."""

    def __init__(self, agent: AgentConfig, tok: Tokenizer, stop_tokens: Sequence[str] = ()):
        self.agent = agent
        self.factory, self.registry = resolve_environment(agent)
        self.chat = ToolChat(tok, self.registry, stop_tokens)
        self.runner = ToolRunner(self.registry, timeout=agent.tool_timeout)

    def environments(self, example: dict, n: int) -> list[ToolTurns]:
        """One environment per branch, made from the group's example; a factory that fails is a ValueError (the
        worker makes it one error on every rank)."""
        try:
            return [ToolTurns(make_environment(self.factory, example), self.chat, self.runner, name=self.agent.env)
                    for _ in range(n)]
        except EnvironmentFailed as e:
            raise ValueError(f"agent.env {self.agent.env!r}: {e}") from e

    def sample(self, model: nn.Module, prefix: PrefixState, settings: SamplingSettings, draw: Draw,
               envs: list[ToolTurns] | None, parallel: SequenceGroup) -> tuple[list[Sample], list[dict], float]:
        """The branches `draw` names, branch i talking with `envs[i]` (rank 0 of the sequence-parallel group; None
        on the others, which never call them): (samples, one JSON record per branch on rank 0 of the group (empty
        on the others), seconds the decode waited on the environments and their tools)."""
        spans: list[tuple[float, float]] = []
        lock = threading.Lock()
        called = [None] * draw.n if envs is None else [TimedEnv(e, spans, lock) for e in envs]
        samples = rollout_turns(model, prefix, settings, draw, called, max_turns=self.agent.max_turns,
                                parallel=parallel)
        return samples, [] if envs is None else [_record(e) for e in envs], _covered(spans)


def _record(env: ToolTurns) -> dict:
    """What one branch's environment said, as JSON."""
    return {"reward": env.reward, **{k: getattr(env, k) for k in COUNTERS},
            "turns": [_turn(t) for t in env.history]}


def _turn(turn: Turn) -> dict:
    return {"text": turn.text,
            "calls": [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in turn.calls],
            "results": [{"name": r.name, "content": r.content, "error": r.error, "seconds": r.seconds}
                        for r in turn.results]}


def observations(sample: Sample, stop_ids: Sequence[int], tok: Tokenizer) -> list[str]:
    """The text of the tokens that followed each turn the model ended with a stop id ("" where none did)."""
    out: list[list[int]] = []
    stops = set(stop_ids)
    for token, wrote in zip(sample.tokens.tolist(), sample.mask.tolist()):
        if wrote and token in stops:
            out.append([])
        elif not wrote and out:  # an observation follows a turn's stop id
            out[-1].append(token)
    return [tok.decode(ids) for ids in out]


def rollout_meta(samples: list[Sample], records: list[dict], stop_ids: Sequence[int], tok: Tokenizer) -> dict:
    """The rollout's "agent" meta: by branch, the environment's reward (None: it gave none), the model's turns,
    the counters, and every turn with its tool calls, results and the observation that followed it."""
    branches = []
    for s, r in zip(samples, records, strict=True):
        seen = observations(s, stop_ids, tok)
        branches.append([{**t, "observation": seen[i] if i < len(seen) else ""} for i, t in enumerate(r["turns"])])
    return {"rewards": [r["reward"] for r in records], "turns": [s.turns for s in samples],
            **{k: [r[k] for r in records] for k in COUNTERS}, "branches": branches}


def agent_metrics(meta: dict) -> dict:
    """A rollout's agent numbers: turns per branch (mean), tool calls, tool errors and seconds in tools (summed
    over calls, which run concurrently)."""
    n = max(len(meta["turns"]), 1)
    return {"turns_mean": sum(meta["turns"]) / n, "tool_calls": sum(meta["tool_calls"]),
            "tool_errors": sum(meta["tool_errors"]), "tool_seconds": sum(meta["tool_seconds"])}
