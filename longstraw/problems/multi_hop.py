"""multi-hop: statements "X points to Y." scattered through filler text; follow k pointers from a start name."""

from __future__ import annotations

import random

from ..data import Example, Tokenizer
from .base import WORDS, Problem, filler_document, first_word, need

NAME = "multi-hop"
_ONSETS = "b d f g h k l m n p r s t v z br dr gr kr pr st tr th sh".split()
_VOWELS = "a e i o u ai ou".split()
_CODAS = ["", "", "n", "r", "l", "s", "x", "m"]


def _names(rng: random.Random, count: int) -> list[str]:
    """Distinct made-up names such as 'Dravon', none of them a filler word."""
    taken = set(WORDS)
    out: list[str] = []
    while len(out) < count:
        name = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(2))
        name = (name + rng.choice(_CODAS)).capitalize()
        if name.lower() not in taken:
            taken.add(name.lower())
            out.append(name)
    return out


def make(seed: int, target_tokens: int, tokenizer: Tokenizer, hops: int | None = None) -> Example:
    rng = random.Random(seed)
    hops = rng.choice((2, 3)) if hops is None else hops
    if not isinstance(hops, int) or hops < 1:
        raise ValueError(f"{NAME}: hops must be an int >= 1, got {hops!r}")
    # the chain goes on past the answer, so the answer is not simply the name that points nowhere
    chain_len = hops + rng.randint(1, 2)
    # distractor chains scale with length, so longer prompts hold more statements to keep apart
    distractors = [rng.randint(2, 4) for _ in range(max(1, min(40, target_tokens // 500)))]
    names = _names(rng, chain_len + 1 + sum(d + 1 for d in distractors))
    chain, rest = names[: chain_len + 1], names[chain_len + 1:]
    links = list(zip(chain, chain[1:]))
    for d in distractors:
        part, rest = rest[: d + 1], rest[d + 1:]
        links += list(zip(part, part[1:]))
    # each statement at its own random place; shuffled, so reading order does not follow the chain
    inserts = [(rng.random(), f"{a} points to {b}.\n") for a, b in links]
    start, answer = chain[0], chain[hops]
    question = (f'Question: each "X points to Y." links X to Y. Start at {start} and follow {hops} links. '
                f"Which name do you reach? Answer with the name only.")
    text, tokens = filler_document(rng, inserts, question, tokenizer, target_tokens, NAME)
    meta = {"task": NAME, "answer": answer, "start": start, "hops": hops, "chain": chain, "num_links": len(links),
            "seed": seed, "target_tokens": target_tokens, "prompt_tokens": tokens}
    return Example(prompt=text, answer=answer, meta=meta)


def verify(meta: dict, response_text: str) -> float:
    """1.0 if the first word of the answer line is the name, case-insensitive ('Answer: **Dravon**.' counts)."""
    return 1.0 if first_word(response_text).casefold() == str(need(meta, "answer", NAME)).casefold() else 0.0


PROBLEM = Problem(NAME, make, verify, "follow k 'X points to Y' statements scattered through filler text")
