"""Problem types and the text helpers the built-in problems share: filler, length fitting, answer parsing."""

from __future__ import annotations

import bisect
import math
import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from ..data import Example, Tokenizer


@dataclass(frozen=True)
class Problem:
    name: str
    make: Callable[..., Example]  # (seed, target_tokens, tokenizer, **options) -> Example
    verify: Callable[[dict, str], float]  # (meta, response_text) -> 1.0 or 0.0
    description: str = ""


# ---- filler text ---------------------------------------------------------------------------------------------

# Plain, neutral words. Tasks rely on what is NOT here: no "points", no needle nouns, so filler never forms a
# pointer statement or a needle by accident.
WORDS = (
    "the a an and or but of in on at by for with from into over under after before between while as if then so "
    "river stone field house garden window road light water forest hill valley morning evening summer winter "
    "cloud rain wind snow sun moon star bridge village market table chair door wall roof paper letter book page "
    "story song voice friend teacher child farmer baker painter sailor traveler neighbor family crowd "
    "walks runs sits stands waits looks listens reads writes sings builds carries opens closes finds keeps leaves "
    "turns follows watches remembers forgets gathers rests moves grows falls rises "
    "quiet old young small large bright dark warm cold green blue red yellow gentle slow quick long short soft "
    "heavy simple careful busy calm early late distant nearby empty full clear "
    "slowly quickly softly often always never sometimes again together alone there here today tomorrow"
).split()


class FillerStream:
    """An endless, seed-determined stream of filler words, each carrying its trailing separator.

    The first n pieces never depend on how far the stream was read, so a prompt can be grown and trimmed while
    its length is being fitted without changing what comes before.
    """

    def __init__(self, seed: int):
        self._rng = random.Random(seed)
        self.pieces: list[str] = []
        self.starts: list[int] = [0]  # indices where a sentence begins

    def _extend(self, n: int) -> None:
        rng = self._rng
        while len(self.pieces) < n:
            words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
            words[0] = words[0].capitalize()
            words[-1] += "."
            end = "\n" if rng.random() < 0.2 else " "  # occasional line breaks, like paragraphs
            self.pieces.extend(w + " " for w in words[:-1])
            self.pieces.append(words[-1] + end)
            self.starts.append(len(self.pieces))

    def text(self, n: int, inserts: Sequence[tuple[float, str]] = ()) -> str:
        """The first n pieces, with each insert placed at the sentence start at or before `fraction * n`."""
        self._extend(n + 1)
        at: dict[int, list[str]] = {}
        for frac, s in inserts:
            k = self.starts[bisect.bisect_right(self.starts, int(frac * n)) - 1]
            at.setdefault(k, []).append(s)
        out = []
        for i, piece in enumerate(self.pieces[:n]):
            out.extend(at.get(i, ()))
            out.append(piece)
        out.extend(at.get(n, ()))
        return "".join(out).rstrip()


# ---- fitting a prompt to a length in tokens ------------------------------------------------------------------

TOLERANCE = 0.05  # promised relative length error


def fit_length(render: Callable[[int], str], tokenizer: Tokenizer, target_tokens: int,
               task: str) -> tuple[str, int, int]:
    """Find the size n (filler units) for which `render(n)` has about target_tokens tokens.

    Tokenization is close to additive over text, so a few proportional steps converge; each step encodes the
    whole prompt once. Returns (text, n, tokens).
    """
    if not isinstance(target_tokens, int) or target_tokens <= 0:
        raise ValueError(f"{task}: target_tokens must be a positive int, got {target_tokens!r}")

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    base = count(render(0))
    if base > target_tokens * (1 + TOLERANCE):
        raise ValueError(f"{task}: target_tokens={target_tokens} is too small: the task's fixed text alone is "
                         f"{base} tokens with this tokenizer; ask for at least {math.ceil(base / 0.95)}")
    probe = 64
    rate = max((count(render(probe)) - base) / probe, 1e-3)  # tokens per filler unit
    n = max(0, round((target_tokens - base) / rate))
    aim = max(1, target_tokens // 200)
    best: tuple[str, int, int] | None = None
    for _ in range(16):
        text = render(n)
        t = count(text)
        if best is None or abs(t - target_tokens) < abs(best[2] - target_tokens):
            best = (text, n, t)
        if abs(t - target_tokens) <= aim:
            break
        if n > 0 and t > base:
            rate = (t - base) / n
        step = round((target_tokens - t) / rate) or (1 if t < target_tokens else -1)
        if n == 0 and step < 0:
            break
        n = max(0, n + step)
    assert best is not None
    if abs(best[2] - target_tokens) > TOLERANCE * target_tokens:
        raise RuntimeError(f"{task}: could not fit the prompt to {target_tokens} tokens (got {best[2]}); "
                           f"this tokenizer tokenizes the filler very unevenly")
    return best


def document_prompt(intro: str, document: str, question: str) -> str:
    """The common layout: instructions, the document between markers, the question last."""
    return f"{intro}\n\n<document>\n{document}\n</document>\n\n{question}"


def filler_document(rng: random.Random, inserts: Sequence[tuple[float, str]], question: str,
                    tokenizer: Tokenizer, target_tokens: int, task: str) -> tuple[str, int]:
    """(prompt, its tokens): `inserts` placed in seed-determined filler grown to target_tokens, then `question`."""
    filler = FillerStream(rng.getrandbits(64))

    def render(n: int) -> str:
        return document_prompt("Read the document, then answer the question after it.",
                               filler.text(n, inserts), question)

    text, _, tokens = fit_length(render, tokenizer, target_tokens, task)
    return text, tokens


# ---- lenient answer extraction -------------------------------------------------------------------------------

_PREFIX = re.compile(r"^\s*(?:the\s+)?(?:final\s+)?answer\s*(?:is\b|:)\s*", re.IGNORECASE)
# a number not glued to letters (so the digits inside a key such as 'k7f3a2' do not count); commas group thousands
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w])")
_NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                 "sixteen seventeen eighteen nineteen twenty").split()
_NUMBER_OR_WORD = re.compile(_NUMBER.pattern + r"|\b(?:" + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE)


def first_line(text: str) -> str:
    """The first non-empty line, without a leading 'Answer:' / 'The answer is'."""
    line = next((ln for ln in text.strip().splitlines() if ln.strip()), "")
    return _PREFIX.sub("", line).strip()


def first_word(text: str) -> str:
    """The first word of the answer line, without quotes, markdown or punctuation around it."""
    words = re.findall(r"\w+", first_line(text))
    return words[0] if words else ""


def first_number(text: str, words: bool = False) -> float | None:
    """The first number in the text ('1,234' -> 1234.0, '3.0' -> 3.0); with words=True also 'three' -> 3.0."""
    m = (_NUMBER_OR_WORD if words else _NUMBER).search(text)
    if m is None:
        return None
    s = m.group(0)
    if s.lower() in _NUMBER_WORDS:
        return float(_NUMBER_WORDS.index(s.lower()))
    return float(s.replace(",", ""))


def need(meta: dict, key: str, who: str):
    """meta[key], or an error that says which field the verifier needs."""
    if not isinstance(meta, dict) or key not in meta:
        raise KeyError(f"{who} needs meta[{key!r}] (the meta of the task example), got {meta!r}")
    return meta[key]
