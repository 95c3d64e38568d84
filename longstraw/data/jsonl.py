"""Prompt datasets as JSONL: one `{"prompt": str, "answer": str, "meta": {...}}` object per line, streamed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

from ..files import write_bytes

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


def _example(raw: bytes, lineno: int, path: str | os.PathLike) -> Example | None:
    """The Example of one raw line (None for a blank one); errors name the file and the line."""
    where = f"{os.fspath(path)}, line {lineno}"
    try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 ({e}); save the file as UTF-8") from None
    if not line.strip():
        return None
    line = line.rstrip("\r\n")  # else a line cut short is reported at "line 2 column 1": its own newline
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: bad JSON ({e.msg} at column {e.pos + 1}); each line must be one JSON "
                         f"object like {_EXAMPLE}") from None
    return _parse(obj, where)


def iter_jsonl(path: str | os.PathLike) -> Iterator[Example]:
    """Yield one Example per non-blank line, reading the file lazily (it may be larger than memory).

    A malformed line raises ValueError naming the file, the line number and the problem when it is reached.
    Fields other than prompt/answer/meta are ignored.
    """
    with open(path, "rb") as f:  # bytes, so that an encoding error can still name its line
        for lineno, raw in enumerate(f, 1):
            if (ex := _example(raw, lineno, path)) is not None:
                yield ex


def example_at(path: str | os.PathLike, offset: int, lineno: int) -> Example:
    """The example on the line that starts at byte `offset` (from a `JsonlIndex`)."""
    with open(path, "rb") as f:
        f.seek(offset)
        ex = _example(f.readline(), lineno, path)
    if ex is None:
        raise ValueError(f"{os.fspath(path)}, line {lineno}: blank where the index expected an example; the file "
                         f"changed under its index, delete {index_path(path)}")
    return ex


def index_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p.with_name(p.name + ".index.json")


class JsonlIndex:
    """Byte offsets and line numbers of a JSONL file's examples, so that example i is one seek away.

    Built in one streaming pass (which also checks every line) and cached beside the file as
    `<file>.index.json`, with the file's size, mtime and sha256: a changed file gets a new index. Where the
    directory is read-only the index lives in memory only."""

    VERSION = 1

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        st = self.path.stat()
        stamp = {"version": self.VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        cached = self._read_cached(stamp)
        if cached is None:
            cached = {**stamp, **self._build()}
            try:
                write_bytes(index_path(self.path), json.dumps(cached).encode())
            except OSError:
                pass  # a read-only dataset directory: rebuilt by each process
        self.offsets: list[int] = cached["offsets"]
        self.lines: list[int] = cached["lines"]
        self.sha256: str = cached["sha256"]
        if not self.offsets:
            raise ValueError(f"dataset {self.path} has no examples")

    def _read_cached(self, stamp: dict) -> dict | None:
        try:
            cached = json.loads(index_path(self.path).read_bytes())
        except (OSError, ValueError):
            return None
        return cached if all(cached.get(k) == v for k, v in stamp.items()) else None

    def _build(self) -> dict:
        offsets, lines, h, pos = [], [], hashlib.sha256(), 0
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                h.update(raw)
                if _example(raw, lineno, self.path) is not None:
                    offsets.append(pos)
                    lines.append(lineno)
                pos += len(raw)
        return {"offsets": offsets, "lines": lines, "sha256": h.hexdigest()}

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> Example:
        """Example i, wrapping around at the end (a dataset cycles)."""
        i %= len(self.offsets)
        return example_at(self.path, self.offsets[i], self.lines[i])
