"""Prompt datasets as JSONL: one `{"prompt": str, "answer": str, "meta": {...}}` object per line, streamed."""

from __future__ import annotations

import json
import os
from typing import Iterator

from .example import Example

_EXAMPLE = '{"prompt": "...", "answer": "42", "meta": {}}'


def _type(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _parse(obj: object, where: str) -> Example:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object like {_EXAMPLE}, got {_type(obj)}")
    if "prompt" not in obj:
        raise ValueError(f"{where}: missing field 'prompt' (a non-empty string)")
    prompt = obj["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: field 'prompt' must be a non-empty string, got {_type(prompt)} {prompt!r:.40}")
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: field 'meta' must be a JSON object, got {_type(meta)}")
    meta = dict(meta)
    if "answer" in obj:
        answer = obj["answer"]
        # numbers are accepted as they are what number_match compares; bools and containers are mistakes
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: field 'answer' must be a string (or a number), got {_type(answer)}")
        answer = str(answer)
        if "answer" in meta and str(meta["answer"]) != answer:
            raise ValueError(f"{where}: 'answer' ({answer!r}) and 'meta.answer' ({meta['answer']!r}) differ; "
                             f"keep one of them")
        meta["answer"] = answer  # rewards read the answer from meta
    elif "answer" in meta:
        answer = str(meta["answer"])
    elif "pattern" in meta:
        answer = ""  # regex_match needs no answer
    else:
        raise ValueError(f"{where}: missing field 'answer' (a string); only examples scored by regex_match "
                         f"(with meta.pattern) may leave it out")
    return Example(prompt=prompt, answer=answer, meta=meta)


def iter_jsonl(path: str | os.PathLike) -> Iterator[Example]:
    """Yield one Example per non-blank line, reading the file lazily (it may be larger than memory).

    A malformed line raises ValueError naming the file, the line number and the problem when it is reached.
    Fields other than prompt/answer/meta are ignored.
    """
    with open(path, "rb") as f:  # bytes, so that an encoding error can still name its line
        for lineno, raw in enumerate(f, 1):
            where = f"{os.fspath(path)}, line {lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 ({e}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: bad JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                                 f"object like {_EXAMPLE}") from None
            yield _parse(obj, where)
