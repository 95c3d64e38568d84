"""Peak memory of scoring one branch over a long captured prefix, as the prefix grows.

The prefix state is held before the measurement starts; what is measured is the extra peak RSS of `score()` for
one response of R tokens. With absorbed MLA (GLM-5) and streamed DSA selection it should stay near-flat (grow at
most linearly in P with a small constant), never like heads x P as an up-projected per-head K/V would.
Each P runs in its own subprocess.

    .venv/bin/python bench/score_memory.py                      # GLM tiny, P in {2K, 8K, 32K, 64K}
    .venv/bin/python bench/score_memory.py --arch dense --P 4096 16384
    .venv/bin/python bench/score_memory.py --quick                # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from archs import ARCHS  # noqa: E402
from worker import parse_or_work, run_or_report, tiny_model  # noqa: E402

MIB = 2**20


def worker(p: dict) -> dict:
    import torch

    import longstraw as ls
    from longstraw.memory import PeakMeter

    model, cfg = tiny_model(p["arch"], p["P"] + p["R"] + 8, p["threads"], **p.get("overrides", {}))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg["vocab_size"], (p["P"],), generator=gen)
    response = torch.randint(0, cfg["vocab_size"], (p["R"],), generator=gen)
    t0 = time.perf_counter()
    state = ls.capture(model, prompt)
    capture_s = time.perf_counter() - t0
    with PeakMeter() as m:
        ls.score(model, state, [response])
    c = model.config
    heads = c.num_attention_heads
    # what an up-projected per-head K/V of the prefix would take (fp32), e.g. transformers' MLA expand_kv
    per_head = getattr(c, "qk_nope_head_dim", 0) + getattr(c, "qk_rope_head_dim", 0) + getattr(c, "v_head_dim", 0)
    per_head = per_head or 2 * c.head_dim
    return {
        **p,
        "state_bytes": state.nbytes,
        "score_peak_bytes": m.peak_bytes,
        "expanded_kv_bytes_per_layer": heads * per_head * p["P"] * 4,
        "capture_s": capture_s,
        "score_s": m.seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="glm_moe_dsa", choices=list(ARCHS))
    ap.add_argument("--P", type=int, nargs="+", default=[2048, 8192, 32768, 65536])
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16, help="attention heads (more heads make heads x P visible)")
    ap.add_argument("--quick", action="store_true", help="smoke run: P in {128, 256}, R = 8, 4 heads")
    args = parse_or_work(ap, "bench/out/score_memory.json", worker)
    if args is None:
        return
    if args.quick:
        args.P, args.R, args.heads = [128, 256], 8, 4
    rows = []
    print(f"{'P':>7} {'state MiB':>10} {'score peak MiB':>15} {'per-head K/V of one layer MiB':>30} {'capture s':>10} {'score s':>8}")
    for p_len in args.P:
        params = {"arch": args.arch, "P": p_len, "R": args.R, "threads": args.threads,
                  "overrides": {"num_attention_heads": args.heads}}
        if (r := run_or_report(__file__, params)) is None:
            continue
        rows.append(r)
        print(f"{p_len:>7} {r['state_bytes'] / MIB:>10.1f} {r['score_peak_bytes'] / MIB:>15.1f} "
              f"{r['expanded_kv_bytes_per_layer'] / MIB:>30.1f} {r['capture_s']:>10.1f} {r['score_s']:>8.2f}", flush=True)
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        growth = (b["score_peak_bytes"] - a["score_peak_bytes"]) / (b["P"] - a["P"])
        print(f"score peak growth: {growth:.1f} B per prefix token "
              f"(per-head K/V of one layer would be {b['expanded_kv_bytes_per_layer'] / b['P']:.0f} B per token)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    if len(rows) < len(args.P):  # each failure was printed above; the exit status says so too
        raise SystemExit(f"{len(args.P) - len(rows)} of {len(args.P)} runs failed")


if __name__ == "__main__":
    main()
