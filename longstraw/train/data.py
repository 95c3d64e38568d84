"""The prompts of a training step: from a built-in task (generated from the seed) or a JSONL dataset (indexed)."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from ..data import Example, JsonlIndex, Tokenizer
from ..problems import make_problem
from .config import TrainConfig


def example_seed(seed: int, step: int, group: int) -> int:
    """A stable 63-bit seed per (run seed, step, group), independent of Python's hash randomisation."""
    digest = hashlib.sha256(f"{seed}/{step}/{group}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@lru_cache(maxsize=8)
def _index(path: str, size: int, mtime_ns: int) -> JsonlIndex:
    return JsonlIndex(path)  # once per process and file version; on disk beside the file for the next process


def dataset_example(path: str, index: int) -> Example:
    """Example `index` of the JSONL file, wrapping around at the end: one seek, from the file's index."""
    st = Path(path).stat()
    return _index(path, st.st_size, st.st_mtime_ns)[index]


def step_example(cfg: TrainConfig, tok: Tokenizer, step: int, group: int) -> Example:
    index = step * cfg.groups + group
    if cfg.dataset is not None:
        return dataset_example(cfg.dataset, index)
    if cfg.task_pool is not None:  # example k of the pool, whatever step it comes up in
        step, group = divmod(index % cfg.task_pool, cfg.groups)
    return make_problem(cfg.task, example_seed(cfg.seed, step, group), cfg.prompt_tokens, tok, **cfg.task_options)


def prompt_ids(tok: Tokenizer, ex: Example) -> list[int]:
    """The prompt as the model sees it: a user turn in the tokenizer's chat format, ready for the answer; a prompt
    already in the chat format (`meta["chat_prompt"]`: an agent task's, its tools listed) as it is."""
    if ex.meta.get("chat_prompt"):
        return tok.encode(ex.prompt)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": ex.prompt}]))
