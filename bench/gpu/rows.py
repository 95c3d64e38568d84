"""The bench's results as they come: each row is appended to rows.jsonl (one JSON object a line) and, formatted,
to table.txt, and both are flushed at once, so a run killed at any point (its timeout, the device's limit) leaves
every row measured before."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

GIB = 2**30


def _num(x) -> str:
    if isinstance(x, float):
        if x == 0 or not math.isfinite(x):
            return str(x)
        return f"{x:.3g}" if abs(x) < 1e-2 or abs(x) >= 1e5 else f"{x:.3f}".rstrip("0").rstrip(".")
    return str(x)


def _errors(errs: dict) -> str:
    return ", ".join(f"{k} {v:.1e}" for k, v in errs.items())


def format_row(row: dict) -> str:
    """One line of table.txt for a row of any section."""
    s = row["section"]
    if "error" in row:
        return f"[{s}] {row.get('what', '')} ERROR {row['error']}"
    if "skipped" in row:
        what = row.get("what") or ", ".join(f"{k} {row[k]}" for k in ("P", "n") if k in row)
        return f"[{s}] {what}: skipped: {row['skipped']}"
    if s == "env":
        return (f"[env] {row.get('gpu', 'cpu')}, torch {row['torch']} (CUDA {row['cuda']}, driver {row['driver']}), "
                f"triton {row['triton']}, FLA kernel {row.get('fla_kernel')}, SDPA "
                f"{row.get('sdpa', {}).get('segment_attention', {}).get('forward')}, dtype {row['dtype']}, "
                f"model {row['model']}")
    if s == "warmup":
        return (f"[warmup] {row['what']}: first call {row['first_s']:.2f} s, second {row['second_s']:.2f} s, "
                f"compile/autotune ~{row['compile_s']:.2f} s")
    if s == "parity":
        verdict = "ok" if row["ok"] else "FAIL"
        return (f"[parity] {row['what']} ({row['path']}): {verdict}, worst rel err {row['worst']:.1e} (tol "
                f"{row['tol']:.0e}; {_errors(row['rel_err'])})")
    if s == "capture":
        return (f"[capture] P {row['P']}: {row['seconds']:.2f} s, {row['tokens_per_s']:.0f} tok/s, "
                f"{row['tflops']:.1f} TFLOP/s, MFU {row['mfu']:.1%}, state {row['state_bytes'] / GIB:.2f} GiB, "
                f"peak {row['peak_bytes'] / GIB:.2f} GiB")
    if s == "profile":
        split = ", ".join(f"{k} {v:.0%}" for k, v in row["share"].items())
        top = "; ".join(f"{name[:60]} {ms:.0f} ms" for name, ms in row["top"][:3])
        return f"[profile] P {row['P']}: {row['total_ms']:.0f} ms of {row['unit']} time: {split} (top: {top})"
    if s == "step":
        return (f"[step] {row['mode']} P {row['P']}, G {row['G']}, R {row['R']}, checkpoint_layers "
                f"{row['checkpoint_layers']}: {row['seconds']:.2f} s (predicted {row['predicted_s']:.0f} s), peak "
                f"{row['peak_bytes'] / GIB:.2f} GiB, plan {row['planned_bytes'] / GIB:.2f} GiB "
                f"(measured / plan {row['peak_over_plan']:.2f})")
    if s == "decode":
        graph = " (CUDA graph)" if row["compile"] == "inductor" else ""
        how = f"compile {row['compile']}{', static' + graph if row['static'] else ''}"
        return (f"[decode] n {row['n']}, {how}: {row['tokens_per_s']:.0f} tok/s ({row['tokens']} tokens at P "
                f"{row['P']}; first run {row['warm_s']:.1f} s; CUDA graph skips {row['cudagraph_skips']})")
    return f"[{s}] " + ", ".join(f"{k} {_num(v)}" for k, v in row.items() if k not in ("section", "t"))


class RowLog:
    """Appends rows to `out`/rows.jsonl and `out`/table.txt (both emptied first) and prints each line."""

    def __init__(self, out: str | Path, echo: bool = True) -> None:
        self.dir = Path(out)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.start = time.perf_counter()
        self.rows: list[dict] = []
        self.echo = echo
        self._jsonl = open(self.dir / "rows.jsonl", "w")  # noqa: SIM115 - held for the run, flushed per row
        self._table = open(self.dir / "table.txt", "w")  # noqa: SIM115

    def add(self, section: str, **fields) -> dict:
        row = {"section": section, **fields, "t": round(time.perf_counter() - self.start, 2)}
        line = format_row(row)
        # the JSON line first: a kill between the two writes leaves the row, not a table line without it
        self._jsonl.write(json.dumps(row, default=str) + "\n")
        self._jsonl.flush()
        self._table.write(line + "\n")
        self._table.flush()
        if self.echo:
            print(line, flush=True)
        self.rows.append(row)
        return row

    def close(self) -> None:
        self._jsonl.close()
        self._table.close()
