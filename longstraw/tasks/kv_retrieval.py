"""kv-retrieval: a long list of `key: value` lines; the question asks for the value of one key."""

from __future__ import annotations

import random

from ..tokenizer import Tokenizer
from .base import Task, TaskExample, document_prompt, first_number, fit_length, need

NAME = "kv-retrieval"
_HEX = "0123456789abcdef"


class _PairStream:
    """Unique random keys ('k' + 5 hex digits) with 6-digit values; the first n pairs never change with n."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)
        self.pairs: list[tuple[str, str]] = []
        self._seen: set[str] = set()

    def take(self, n: int) -> list[tuple[str, str]]:
        rng = self._rng
        while len(self.pairs) < n:
            key = "k" + "".join(rng.choice(_HEX) for _ in range(5))
            value = str(rng.randint(100000, 999999))
            if key not in self._seen:  # a repeated key would make the answer ambiguous
                self._seen.add(key)
                self.pairs.append((key, value))
        return self.pairs[:n]


def make(seed: int, target_tokens: int, tokenizer: Tokenizer) -> TaskExample:
    rng = random.Random(seed)
    stream = _PairStream(rng.getrandbits(64))
    where = rng.random()  # relative position of the asked-for pair, kept while the list is resized

    def pick(n: int) -> tuple[list[tuple[str, str]], int]:
        pairs = stream.take(n + 1)  # n extra pairs around the one that is asked for
        return pairs, min(int(where * len(pairs)), len(pairs) - 1)

    def render(n: int) -> str:
        pairs, q = pick(n)
        doc = "\n".join(f"{k}: {v}" for k, v in pairs)
        return document_prompt(
            "The document below lists keys and their values, one `key: value` pair per line.",
            doc,
            f"Question: what is the value of key {pairs[q][0]}? Answer with the value only.",
        )

    text, n, tokens = fit_length(render, tokenizer, target_tokens, NAME)
    pairs, q = pick(n)
    key, value = pairs[q]
    meta = {"task": NAME, "answer": value, "key": key, "position": q, "num_pairs": len(pairs), "seed": seed,
            "target_tokens": target_tokens, "prompt_tokens": tokens}
    return TaskExample(prompt=text, answer=value, meta=meta)


def verify(meta: dict, response_text: str) -> float:
    """1.0 if the first number in the response is the value (digits inside keys such as 'k7f3a2' are ignored)."""
    got = first_number(response_text)
    return 1.0 if got is not None and got == float(need(meta, "answer", NAME)) else 0.0


TASK = Task(NAME, make, verify, "find the value of one key among many `key: value` lines")
