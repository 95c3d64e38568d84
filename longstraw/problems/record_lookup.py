"""record-lookup: the built-in agent task. A long document lists records (an id and a description each); their
values are NOT in the document. The question asks for one record's value, which only the `lookup` tool returns.

The prompt is the whole chat prompt with the tool listed (the tokenizer's chat template with `tools=[TOOL]`, what
`agents.ToolChat(tok, registry).prompt([user])` writes; the problems floor cannot import agents, so the schema is
spelled out here and agents/builtin.py registers the tool with it), sized to target_tokens with the template
included. `meta["chat_prompt"]` says so: the prompt is encoded as it is, not wrapped in a user turn again.

A value is a pure function of its record id (a keyed hash), so the tool needs no per-example state, and any id
that the document could hold is valid: an id is 'r', 4 hex digits and a check digit, so an id the model makes up
is unknown (an error result) but for 1 in 16 (short ids: a tiny model copies them into its call).
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Literal

from ..data import Example, Tokenizer
from .base import Problem, document_prompt, first_number, fit_length, need

NAME = "record-lookup"
_HEX = "0123456789abcdef"
_SALT = b"longstraw/record-lookup/v1"
VALUE_DIGITS = 4
_ID = re.compile(r"r([0-9a-f]{4})([0-9a-f])")

# the function schema the chat template lists, exactly what ToolRegistry.schemas() gives for the registered tool
# (short: a tiny byte-level model reads it in every prompt)
TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "A record's value.",
    "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}}

_KINDS = "bridge lantern garden letter basket ladder window compass kettle mirror anchor saddle".split()
_COLOURS = "amber copper violet silver crimson olive ivory cobalt scarlet golden".split()
_PLACES = "harbor cellar tower meadow market chapel mill orchard".split()


def _check(base: str) -> str:
    return hashlib.sha256(_SALT + b"check/" + base.encode()).hexdigest()[:1]


def record_id(base: str) -> str:
    """The id of a record whose 4 hex digits are `base`: 'r' + base + its check digit."""
    return f"r{base}{_check(base)}"


def is_record_id(text: str) -> bool:
    m = _ID.fullmatch(text)
    return m is not None and _check(m.group(1)) == m.group(2)


def record_value(rid: str) -> str:
    """The value of record `rid` (VALUE_DIGITS digits, no leading zero); a KeyError for an id no document holds.
    (One fixed width: the tool is one function for every example, so it cannot follow a per-example option.)"""
    if not isinstance(rid, str) or not is_record_id(rid.strip()):
        raise KeyError(f"unknown record id {rid!r}")  # short: the model reads it within its token budget
    lo = 10 ** (VALUE_DIGITS - 1)
    h = int.from_bytes(hashlib.sha256(_SALT + b"value/" + rid.strip().encode()).digest()[:8], "little")
    return str(lo + h % (9 * lo))


class _RecordStream:
    """Records (id, description) with unique ids and descriptions; the first n never change with n."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)
        self.records: list[tuple[str, str]] = []
        self._ids: set[str] = set()
        self._descriptions: set[str] = set()

    def take(self, n: int) -> list[tuple[str, str]]:
        most = min(16**4, len(_KINDS) * len(_COLOURS) * len(_PLACES) * 99)
        if n > most:
            raise ValueError(f"{NAME}: {n} records are more than the {most} distinct ones the task can make; ask "
                             f"for fewer tokens")
        rng = self._rng
        while len(self.records) < n:
            rid = record_id("".join(rng.choice(_HEX) for _ in range(4)))
            desc = f"the {rng.choice(_COLOURS)} {rng.choice(_KINDS)} of {rng.choice(_PLACES)} {rng.randint(1, 99)}"
            if rid not in self._ids and desc not in self._descriptions:  # each must name one record
                self._ids.add(rid)
                self._descriptions.add(desc)
                self.records.append((rid, desc))
        return self.records[:n]


def make(seed: int, target_tokens: int, tokenizer: Tokenizer,
         ask_by: Literal["id", "description"] = "id") -> Example:
    """Option `ask_by`: whether the question names the record by its id (the model copies it into the call) or by
    its description (the model must first find the id in the document: a long-context retrieval before the
    call)."""
    if ask_by not in ("id", "description"):
        raise ValueError(f"{NAME}: ask_by must be 'id' or 'description', got {ask_by!r}")
    rng = random.Random(seed)
    stream = _RecordStream(rng.getrandbits(64))
    where = rng.random()  # relative position of the asked-for record, kept while the list is resized

    def pick(n: int) -> tuple[list[tuple[str, str]], int]:
        records = stream.take(n + 1)
        return records, min(int(where * len(records)), len(records) - 1)

    def user(n: int) -> str:
        records, q = pick(n)
        rid, desc = records[q]
        named = f"record {rid}" if ask_by == "id" else f"the record described as {desc!r}"
        return document_prompt(
            "Records, one `id: description` per line; only the lookup tool knows their values.",
            "\n".join(f"{r}: {d}" for r, d in records),
            f"Question: what is the value of {named}? Answer with the value only.")

    def render(n: int) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": user(n)}], tools=[TOOL])

    text, n, tokens = fit_length(render, tokenizer, target_tokens, NAME)
    records, q = pick(n)
    rid = records[q][0]
    value = record_value(rid)
    meta = {"task": NAME, "answer": value, "id": rid, "description": records[q][1], "position": q,
            "num_records": len(records), "ask_by": ask_by, "seed": seed,
            "target_tokens": target_tokens, "prompt_tokens": tokens, "chat_prompt": True}
    return Example(prompt=text, answer=value, meta=meta)


def final_answer(response_text: str) -> str:
    """The model's final answer: its text after its last tool call (the model's own text; a transcript with the
    observations rendered in would hold the tool's value there)."""
    return response_text.rpartition("</tool_call>")[2]


def verify(meta: dict, response_text: str) -> float:
    """1.0 if the first number of the final answer (after the last tool call) is the record's value."""
    got = first_number(final_answer(response_text))
    return 1.0 if got is not None and got == float(need(meta, "answer", NAME)) else 0.0


PROBLEM = Problem(NAME, make, verify, "find one record's value, which only the lookup tool knows (an agent task)")
