"""Reward functions `reward(prompt_meta, response_text) -> float | None`, by name or as "module:function"; None:
the function does not apply to that response."""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Callable, NamedTuple, Sequence

from ..problems import PROBLEMS
from ..named import load_named
from ..problems.base import first_number, need

log = logging.getLogger("longstraw")

RewardFn = Callable[[dict, str], float | None]
_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make a reward available to `get_reward(name)` (and so to run configs)."""

    def add(fn: RewardFn) -> RewardFn:
        if name in _REWARDS and _REWARDS[name] is not fn:
            raise ValueError(f"a reward named {name!r} is already registered ({_REWARDS[name]!r}); pick another name")
        _REWARDS[name] = fn
        return fn

    return add


def reward_names() -> list[str]:
    return sorted(_REWARDS)


def get_reward(spec: str) -> RewardFn:
    """A registered name (see reward_names()) or "package.module:function" importable from sys.path."""
    if spec in _REWARDS:
        return _REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}; registered rewards: {', '.join(reward_names())}; "
                         f"or give your own as 'module:function'")
    return load_named(spec, "reward", "my_rewards:score", "fn(prompt_meta: dict, response_text: str) -> float")


def _as_number(value: Any) -> float | None:
    """The value as a float (NaN and inf included), or None (strings, None, tensors with more than one element)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


class Scored(NamedTuple):
    rewards: list[float]
    failed: int  # raised, or returned no finite number: scored 0.0
    nan: int  # of those, returned NaN: not logged one by one, the caller weighs the share and logs once


def compute_rewards(fn: RewardFn, metas: Sequence[dict], texts: Sequence[str]) -> Scored:
    """Reward per sample, and how many failed. A reward that returns None does not apply to that sample (as in
    TRL): it scores NaN, which the advantages leave out. A reward that raises or returns no finite number scores
    0.0 and is logged (NaN only counted): one bad sample must not end a training run."""
    if len(metas) != len(texts):
        raise ValueError(f"compute_rewards got {len(metas)} metas but {len(texts)} texts; pass one meta per text")
    name = getattr(fn, "__name__", repr(fn))
    rewards: list[float] = []
    failed = nan = 0
    for i, (meta, text) in enumerate(zip(metas, texts)):
        try:
            value = fn(meta, text)
        except Exception as e:
            log.warning("reward %s raised on sample %d, scored 0.0: %s: %s", name, i, type(e).__name__, e)
            rewards.append(0.0)
            failed += 1
            continue
        if value is None:
            rewards.append(math.nan)
            continue
        v = _as_number(value)
        if v is None or not math.isfinite(v):
            if v is not None and math.isnan(v):
                nan += 1
            else:
                log.warning("reward %s returned %r on sample %d, not a finite number; scored 0.0", name, value, i)
            rewards.append(0.0)
            failed += 1
        else:
            rewards.append(v)
    return Scored(rewards, failed, nan)


# ---- built-ins ----------------------------------------------------------------------------------------------


@register_reward("exact_match")
def exact_match(prompt_meta: dict, response_text: str) -> float:
    """1.0 if the response, stripped, equals meta["answer"]."""
    return 1.0 if response_text.strip() == str(need(prompt_meta, "answer", "exact_match")).strip() else 0.0


@register_reward("number_match")
def number_match(prompt_meta: dict, response_text: str) -> float:
    """1.0 if the first number in the response equals meta["answer"] numerically ('1,000.0' == 1000)."""
    answer = need(prompt_meta, "answer", "number_match")
    expected = float(answer) if isinstance(answer, (int, float)) else first_number(str(answer))
    if expected is None:
        raise ValueError(f"number_match: meta['answer'] = {answer!r} holds no number")
    got = first_number(response_text)
    return 1.0 if got is not None and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12) else 0.0


@register_reward("regex_match")
def regex_match(prompt_meta: dict, response_text: str) -> float:
    """1.0 if the regular expression meta["pattern"] matches anywhere in the response."""
    return 1.0 if re.search(need(prompt_meta, "pattern", "regex_match"), response_text) else 0.0


@register_reward("digit_overlap")
def digit_overlap(prompt_meta: dict, response_text: str) -> float:
    """Partial credit for an integer answer: the share of positions at which the first number of the response
    has the answer's digit, over the longer of the two (1.0 exactly when the numbers are equal). A denser signal
    than exact match for a model that still garbles some digits; report accuracy (reward 1.0) beside it."""
    answer = str(need(prompt_meta, "answer", "digit_overlap")).strip()
    if not answer.isdigit():
        raise ValueError(f"digit_overlap: meta['answer'] = {answer!r} is not a non-negative integer")
    got = first_number(response_text)
    if got is None or got < 0 or got != int(got):
        return 0.0
    digits = str(int(got))
    return sum(a == b for a, b in zip(digits, answer)) / max(len(digits), len(answer))


for _name, _task in PROBLEMS.items():  # each task's verifier is a reward under the task's name
    register_reward(_name)(_task.verify)
