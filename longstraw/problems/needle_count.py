"""needle-count: one needle sentence repeated a random number of times in filler text; how many times?"""

from __future__ import annotations

import random

from ..data import Example, Tokenizer
from .base import Problem, filler_document, first_number, need

NAME = "needle-count"
# each holds a word that is not a filler word, so filler can never form a needle by accident
NEEDLES = (
    "The purple walrus hums a quiet tune.",
    "A copper lantern glows beside the well.",
    "The violet kite drifts above the harbor.",
    "An amber owl guards the silver key.",
    "The marble fox counts seven pebbles.",
    "A crimson heron waits by the canal.",
)


def make(seed: int, target_tokens: int, tokenizer: Tokenizer) -> Example:
    rng = random.Random(seed)
    needle = rng.choice(NEEDLES)
    # short prompts get fewer needles so that filler still dominates the text
    count = rng.randint(1, max(2, min(10, target_tokens // 300)))
    inserts = [(rng.random(), needle + " ") for _ in range(count)]
    question = (f'Question: how many times does the sentence "{needle}" appear in the document? '
                f"Answer with a number only.")
    text, tokens = filler_document(rng, inserts, question, tokenizer, target_tokens, NAME)
    meta = {"task": NAME, "answer": str(count), "needle": needle, "seed": seed, "target_tokens": target_tokens,
            "prompt_tokens": tokens}
    return Example(prompt=text, answer=str(count), meta=meta)


def verify(meta: dict, response_text: str) -> float:
    """1.0 if the first number in the response (digits or a word up to 'twenty') equals the count."""
    got = first_number(response_text, words=True)
    return 1.0 if got is not None and got == float(need(meta, "answer", NAME)) else 0.0


PROBLEM = Problem(NAME, make, verify, "count how often a needle sentence appears in filler text")
