"""Rollout throughput and memory: n branches decoded together on one shared prefix state.

Each n runs in its own subprocess: capture the prompt, then time `rollout` (fixed length: no stop ids) and read
the extra peak RSS. Memory should grow with n only by the branches' own tokens, never by n copies of the prefix.
With `--compile`, each n also runs with the decode step under torch.compile (inductor), dynamic and static (the
static decode: one graph for all steps, a CUDA graph on a GPU). Every run is made twice and the second is timed:
the first pays the compilation (column `first s`).

    .venv/bin/python bench/rollout.py                    # tiny dense model, 16K-token prompt, n in {1, 8}
    .venv/bin/python bench/rollout.py --arch qwen3_5 --n 1 4 8 16
    .venv/bin/python bench/rollout.py --compile --P 1024  # eager against compiled decoding
    .venv/bin/python bench/rollout.py --quick             # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from archs import ARCHS  # noqa: E402
from worker import parse_or_work, run_or_report, tiny_model  # noqa: E402

MIB = 2**20


def worker(p: dict) -> dict:
    import torch

    import longstraw as ls
    from longstraw.memory import PeakMeter

    model, cfg = tiny_model(p["arch"], p["P"] + p["tokens"] + 8, p["threads"])
    prompt = torch.randint(0, cfg["vocab_size"], (p["P"],), generator=torch.Generator().manual_seed(1))
    state = ls.capture(model, prompt)
    args = (ls.SamplingSettings(max_new_tokens=p["tokens"], temperature=1.0), ls.Draw(n=p["n"], seed=0))
    decode = ls.DecodeOptions(compile=p["compile"], static_shapes=p["static"])
    with PeakMeter() as first:
        ls.rollout(model, state, *args, decode=decode)
    with PeakMeter() as m:
        samples = ls.rollout(model, state, *args, decode=decode)
    generated = sum(len(s.tokens) for s in samples)
    return {**p, "seconds": m.seconds, "first_seconds": first.seconds, "tokens_per_s": generated / m.seconds,
            "peak_bytes": m.peak_bytes, "state_bytes": state.nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="dense", choices=list(ARCHS))
    ap.add_argument("--P", type=int, default=16384, help="prompt tokens")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8], help="branches")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per branch")
    ap.add_argument("--compile", action="store_true", help="also run each n with the decode step compiled")
    ap.add_argument("--quick", action="store_true", help="smoke run: P = 128, n in {1, 2}, 4 new tokens")
    args = parse_or_work(ap, "bench/out/rollout.json", worker)
    if args is None:
        return
    if args.quick:
        args.P, args.n, args.tokens = 128, [1, 2], 4
    rows, failed = [], 0
    print(f"rollout bench: arch={args.arch} P={args.P} new tokens={args.tokens} threads={args.threads}")
    print(f"{'n':>4} {'compile':>8} {'seconds':>8} {'first s':>8} {'tokens/s':>9} {'peak MiB':>9} {'state MiB':>10} "
          f"{'n x state MiB':>14}")
    for n in args.n:
        for compile, static in [(False, False), ("inductor", False), ("inductor", True)][: 3 if args.compile else 1]:
            params = {"arch": args.arch, "P": args.P, "n": n, "tokens": args.tokens, "threads": args.threads,
                      "compile": compile, "static": static}
            if (r := run_or_report(__file__, params)) is None:
                failed += 1
                continue
            rows.append(r)
            print(f"{n:>4} {'static' if static else compile or 'off':>8} {r['seconds']:>8.2f} {r['first_seconds']:>8.2f} "
                  f"{r['tokens_per_s']:>9.1f} {r['peak_bytes'] / MIB:>9.1f} {r['state_bytes'] / MIB:>10.1f} "
                  f"{n * r['state_bytes'] / MIB:>14.1f}", flush=True)
    eager = [r for r in rows if not r["compile"]]
    if len(eager) >= 2:
        print(f"throughput n={eager[-1]['n']} / n={eager[0]['n']}: "
              f"{eager[-1]['tokens_per_s'] / eager[0]['tokens_per_s']:.2f}x")
    for r in rows:
        base = next((e for e in eager if e["n"] == r["n"]), None)
        if r["compile"] and base is not None:
            print(f"compiled{' static' if r['static'] else ''} / eager at n={r['n']}: "
                  f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    if failed:  # each failure was printed above; the exit status says so too
        raise SystemExit(f"{failed} of {failed + len(rows)} runs failed")


if __name__ == "__main__":
    main()
