"""Run one benchmark measurement in a fresh subprocess (so peak memory of one run never leaks into the next)."""

from __future__ import annotations

import json
import subprocess
import sys

TAG = "BENCH_RESULT "


def report(result: dict) -> None:
    """Worker side: hand the result to the parent on stdout."""
    print(TAG + json.dumps(result), flush=True)


def run_worker(script: str, params: dict) -> dict | None:
    """Parent side: run `script --worker <params>`; the worker's result, or None (its stderr is printed)."""
    out = subprocess.run([sys.executable, script, "--worker", json.dumps(params)], capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith(TAG)), None)
    if line is None:
        print(f"worker {params} failed:\n{out.stderr[-2000:]}", flush=True)
        return None
    return json.loads(line[len(TAG) :])


def tiny_model(arch: str, max_positions: int, threads: int, **overrides):
    """(model, its config dict) of a benchmark architecture, built with a fixed seed on `threads` threads."""
    import torch

    import longstraw as ls
    from grpo_step import ARCHS

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = {**ARCHS[arch](max_positions), **overrides}
    return ls.build_model(cfg), cfg
