"""Synthetic long-context tasks with verifiable answers, sized to a target length in tokens.

Each task builds a prompt from a seed (same seed, same tokenizer, same length: same task) and checks a response
with `verify(meta, response_text) -> 1.0 | 0.0`. Lengths are measured with the tokenizer passed in, on the prompt
text itself (a chat template adds its few tokens on top).
"""

from __future__ import annotations

from . import kv_retrieval, multi_hop, needle_count
from ..tokenizer import Tokenizer
from .base import Task, TaskExample

TASKS: dict[str, Task] = {t.name: t for t in (kv_retrieval.TASK, multi_hop.TASK, needle_count.TASK)}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None


def make_task(name: str, seed: int, target_tokens: int, tokenizer: Tokenizer, **options) -> TaskExample:
    """One example of task `name`, about target_tokens tokens long (within 5%) under `tokenizer`."""
    return get_task(name).make(seed, target_tokens, tokenizer, **options)


__all__ = ["TASKS", "Task", "TaskExample", "get_task", "make_task"]
