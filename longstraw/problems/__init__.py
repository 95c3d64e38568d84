"""The built-in synthetic long-context problems (a run config's `task`), with verifiable answers, sized to a
target length in tokens. (Named `problems`, not `tasks`: the top-level `tasks/` holds the Prefect stage tasks.)

Each problem builds a prompt from a seed (same seed, same tokenizer, same length: same task) and checks a response
with `verify(meta, response_text) -> 1.0 | 0.0`. Lengths are measured with the tokenizer passed in, on the prompt
text itself (a chat template adds its few tokens on top).
"""

from __future__ import annotations

import inspect

from ..data import Example, Tokenizer
from . import kv_retrieval, multi_hop, needle_count, record_lookup
from .base import Problem

PROBLEMS: dict[str, Problem] = {t.name: t for t in (kv_retrieval.PROBLEM, multi_hop.PROBLEM, needle_count.PROBLEM,
                                                    record_lookup.PROBLEM)}


def get_problem(name: str) -> Problem:
    try:
        return PROBLEMS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(PROBLEMS))}") from None


def make_problem(name: str, seed: int, target_tokens: int, tokenizer: Tokenizer, **options) -> Example:
    """One example of task `name`, about target_tokens tokens long (within 5%) under `tokenizer`."""
    problem = get_problem(name)
    known = list(inspect.signature(problem.make).parameters)[3:]  # after seed, target_tokens, tokenizer
    if unknown := sorted(set(options) - set(known)):
        raise ValueError(f"task_options {unknown} are not options of task {name!r}; its options: "
                         f"{', '.join(known) or 'none'}")
    return problem.make(seed, target_tokens, tokenizer, **options)


__all__ = ["PROBLEMS", "Example", "Problem", "get_problem", "make_problem"]
