"""JSONL prompt datasets: parsing, clear errors with line numbers, streaming."""

from __future__ import annotations

import json
import os
import threading

import pytest

from longstraw.data import iter_jsonl


def write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_round_trip(tmp_path):
    rows = [
        {"prompt": "What is 2+2?", "answer": "4", "meta": {"task": "arith", "difficulty": 1}},
        {"prompt": "Name a colour: é 日本", "answer": "red"},
        {"prompt": "Say hello", "meta": {"pattern": "(?i)hello"}},
        {"prompt": "How many?", "answer": 12},
    ]
    path = write(tmp_path / "d.jsonl", [json.dumps(rows[0]), "", "   ", json.dumps(rows[1], ensure_ascii=False),
                                        json.dumps(rows[2]), json.dumps(rows[3])])
    got = list(iter_jsonl(path))
    assert [e.prompt for e in got] == [r["prompt"] for r in rows]
    assert [e.answer for e in got] == ["4", "red", "", "12"]
    assert got[0].meta == {"task": "arith", "difficulty": 1, "answer": "4"}  # answer copied for rewards
    assert got[1].meta == {"answer": "red"}
    assert got[2].meta == {"pattern": "(?i)hello"}
    assert got[3].meta["answer"] == "12"


@pytest.mark.parametrize("line,field", [
    ('{"prompt": "x", "answer": ', "bad JSON"),
    ('["prompt", "answer"]', "JSON object"),
    ('"just a string"', "JSON object"),
    ('{"answer": "4"}', "prompt"),
    ('{"prompt": 5, "answer": "4"}', "prompt"),
    ('{"prompt": "", "answer": "4"}', "prompt"),
    ('{"prompt": "x", "answer": ["4"]}', "answer"),
    ('{"prompt": "x", "answer": true}', "answer"),
    ('{"prompt": "x"}', "answer"),
    ('{"prompt": "x", "answer": "4", "meta": [1]}', "meta"),
    ('{"prompt": "x", "answer": "4", "meta": {"answer": "5"}}', "answer"),
])
def test_malformed_line_names_line_and_field(tmp_path, line, field):
    good = json.dumps({"prompt": "ok", "answer": "1"})
    path = write(tmp_path / "bad.jsonl", [good, "", line, good])
    with pytest.raises(ValueError) as e:
        list(iter_jsonl(path))
    msg = str(e.value)
    assert "line 3" in msg and str(path) in msg and field in msg


def test_not_utf8_names_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError, match="line 2.*UTF-8"):
        list(iter_jsonl(path))


def test_streams(tmp_path):
    # the first example is usable although later lines are broken: lines are read only as they are needed
    path = write(tmp_path / "s.jsonl", [json.dumps({"prompt": "first", "answer": "1"}), "{not json", "[]"])
    it = iter_jsonl(path)
    assert next(it).prompt == "first"
    with pytest.raises(ValueError, match="line 2"):
        next(it)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_streams_from_a_pipe(tmp_path):
    # the writer sends the second line only after the reader has the first: a reader that waited for the end of
    # the file would get the first example only after the writer gave up waiting
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    got_first = threading.Event()
    in_time: list[bool] = []

    def writer():
        with open(fifo, "w", encoding="utf-8") as f:
            f.write(json.dumps({"prompt": "one", "answer": "1"}) + "\n")
            f.flush()
            in_time.append(got_first.wait(timeout=5))
            f.write(json.dumps({"prompt": "two", "answer": "2"}) + "\n")

    t = threading.Thread(target=writer)
    t.start()
    try:
        it = iter_jsonl(fifo)
        assert next(it).prompt == "one"
        got_first.set()
        assert [e.prompt for e in it] == ["two"]
    finally:
        got_first.set()
        t.join()
    assert in_time == [True], "the first example came only after the whole file was written"


def test_bom_and_missing_file(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes("\ufeff".encode() + b'{"prompt": "p", "answer": "a"}\n')
    assert [e.prompt for e in iter_jsonl(path)] == ["p"]
    with pytest.raises(FileNotFoundError):
        list(iter_jsonl(tmp_path / "absent.jsonl"))


def test_index_is_built_once_and_reads_by_seek(tmp_path, monkeypatch):
    """`JsonlIndex`: the examples iter_jsonl gives, one seek each, wrapping around; built in one pass and cached
    beside the file; a changed file gets a new index; an error still names its line."""
    from longstraw.data import JsonlIndex
    from longstraw.data import jsonl as mod

    rows = [json.dumps({"prompt": f"q{i} é", "answer": str(i)}, ensure_ascii=False) for i in range(5)]
    path = write(tmp_path / "d.jsonl", [rows[0], "", *rows[1:3], "  ", *rows[3:]])
    idx = JsonlIndex(path)
    want = list(iter_jsonl(path))
    assert len(idx) == 5 and [idx[i] for i in range(5)] == want and idx[7] == want[2]
    cached = json.loads((tmp_path / "d.jsonl.index.json").read_text())
    assert cached["lines"] == [1, 3, 4, 6, 7] and len(cached["sha256"]) == 64

    builds = []
    real = mod.JsonlIndex._build
    monkeypatch.setattr(mod.JsonlIndex, "_build", lambda self: builds.append(1) or real(self))
    assert JsonlIndex(path)[4] == want[4] and builds == []  # the cached index, no scan
    write(path, [rows[4], "{bad json"])
    with pytest.raises(ValueError, match="d.jsonl, line 2: bad JSON"):
        JsonlIndex(path)
    write(path, [rows[4], rows[0]])
    assert JsonlIndex(path)[0].prompt == "q4 é" and builds == [1, 1]


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_a_line_cut_short_is_reported_where_it_ends(tmp_path, newline):
    # the column json reports must be the line's own, not "column 1" of the newline after it
    full = json.dumps({"prompt": "p" * 150, "answer": "42"})
    cut = full[:full.index('"answer"')]  # ends after '", ': the next key never comes
    path = tmp_path / "cut.jsonl"
    path.write_bytes((full + newline + cut + newline).encode())
    with pytest.raises(ValueError, match=rf"line 2: bad JSON \(.* at column {len(cut) + 1}\)"):
        list(iter_jsonl(path))
