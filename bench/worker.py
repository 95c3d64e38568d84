"""Run one benchmark measurement in a fresh subprocess (so peak memory of one run never leaks into the next)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TAG = "BENCH_RESULT "


def report(result: dict) -> None:
    """Worker side: hand the result to the parent on stdout."""
    print(TAG + json.dumps(result), flush=True)


def parse_or_work(ap: argparse.ArgumentParser, out: str, worker) -> argparse.Namespace | None:
    """Add the common --threads/--out/--worker options and parse. In the --worker role, run `worker` on the
    given params, report its result and return None; else return the parent's arguments."""
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=out)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        report(worker(json.loads(args.worker)))
        return None
    return args


def run_worker(script: str, params: dict, timeout: float | None = None) -> dict:
    """Parent side: run `script --worker <params>`. The worker's result with `process_seconds` added, or `params`
    with an `error` (timeout, or the exit status and the tail of the worker's output)."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, os.path.abspath(script), "--worker", json.dumps(params)],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**params, "error": f"timed out after {timeout:.0f} s"}
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith(TAG)), None)
    if line is None:
        tail = (out.stderr or out.stdout).strip().splitlines()[-15:]
        return {**params, "error": f"worker exit {out.returncode}: " + "\n".join(tail)}
    return {**json.loads(line[len(TAG) :]), "process_seconds": time.perf_counter() - t0}


def run_or_report(script: str, params: dict, timeout: float | None = None) -> dict | None:
    """`run_worker`, printing a failed worker's error (None then) so a sweep goes on with the next point."""
    r = run_worker(script, params, timeout)
    if "error" in r:
        print(f"worker {params} failed: {r['error']}", flush=True)
        return None
    return r


def tiny_model(arch: str, max_positions: int, threads: int, **overrides):
    """(model, its config dict) of a benchmark architecture, built with a fixed seed on `threads` threads."""
    import torch

    import longstraw as ls
    from archs import ARCHS

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = {**ARCHS[arch](max_positions), **overrides}
    return ls.build_model(cfg), cfg
