"""kv-retrieval: a long list of `key: value` lines; the question asks for the value of one key."""

from __future__ import annotations

import random

from ..data import Example, Tokenizer
from .base import Problem, document_prompt, first_number, fit_length, need

NAME = "kv-retrieval"
_HEX = "0123456789abcdef"


class _PairStream:
    """Unique random keys ('k' + key_chars hex digits) with value_digits-digit values (no leading zero); the first
    n pairs never change with n."""

    def __init__(self, seed: int, key_chars: int = 5, value_digits: int = 6):
        self._rng = random.Random(seed)
        self.key_chars, self.value_digits = key_chars, value_digits
        self.pairs: list[tuple[str, str]] = []
        self._seen: set[str] = set()

    def take(self, n: int) -> list[tuple[str, str]]:
        rng = self._rng
        if n > 16**self.key_chars:
            raise ValueError(f"{NAME}: {n} pairs need more distinct keys than key_chars={self.key_chars} allows "
                             f"({16**self.key_chars}); ask for fewer tokens or longer keys")
        lo = 10 ** (self.value_digits - 1)
        while len(self.pairs) < n:
            key = "k" + "".join(rng.choice(_HEX) for _ in range(self.key_chars))
            value = str(rng.randint(lo, 10 * lo - 1))
            if key not in self._seen:  # a repeated key would make the answer ambiguous
                self._seen.add(key)
                self.pairs.append((key, value))
        return self.pairs[:n]


def make(seed: int, target_tokens: int, tokenizer: Tokenizer, key_chars: int = 5,
         value_digits: int = 6) -> Example:
    """Options (defaults give the standard task): `key_chars`, hex digits after the 'k' of each key (>= 2;
    keys are unique, so 2 allows at most 256 pairs); `value_digits`, digits of each value (>= 1). Shorter keys and values
    make an easier task, e.g. for warm-starting a tiny byte-level model."""
    for opt, v, least in (("key_chars", key_chars, 2), ("value_digits", value_digits, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"{NAME}: {opt} must be an int >= {least}, got {v!r}")
    rng = random.Random(seed)
    stream = _PairStream(rng.getrandbits(64), key_chars, value_digits)
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
            "target_tokens": target_tokens, "prompt_tokens": tokens, "key_chars": key_chars, "value_digits": value_digits}
    return Example(prompt=text, answer=value, meta=meta)


def verify(meta: dict, response_text: str) -> float:
    """1.0 if the first number in the response is the value (digits inside keys such as 'k7f3a2' are ignored)."""
    got = first_number(response_text)
    return 1.0 if got is not None and got == float(need(meta, "answer", NAME)) else 0.0


PROBLEM = Problem(NAME, make, verify, "find the value of one key among many `key: value` lines")
