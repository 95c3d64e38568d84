"""The planner's CPU figure beside a measured step: reads `bench/dist_step.py`'s JSON (an exact step's peak RSS
above the RSS before it, per rank, and with `--track` the peak of its live storages) and prints, per row, what
`longstraw plan` counts for the same step on the CPU path (fp32, the torch delta rule, no optimizer: dist_step
measures `grpo_backward` alone): gradients, the state and dState shards, boundary states and the larger of the
prompt chunk's and the branch's peaks.

    .venv/bin/python bench/dist_step.py --N 1 2 --P 16384 --G 4 --R 256 --hidden 1024 \\
        --checkpoint-layers off on --track --out bench/out/checkpoint_step.json
    .venv/bin/python bench/plan_vs_step.py bench/out/checkpoint_step.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_step import model_config  # noqa: E402

from longstraw.tools.activations import activation_profile  # noqa: E402
from longstraw.tools.plan import Cluster, EngineChoice, Workload, plan  # noqa: E402

MIB = 2**20
STEP_TERMS = ("state shard", "dState shard", "boundary states")


def planned_step_bytes(r: dict) -> float:
    """What of a plan one `grpo_backward` allocates: fp32 gradients (ZeRO-0: whole on every rank), state,
    dState, boundaries and the work's peak."""
    pr = r["per_rank"]
    work = max(pr["one chunk's activations"] + pr["chunk backward transients"],
               pr["one branch's activations"] + pr["LM head chunk + queries"])
    return 4 * r["parameters"] + sum(pr[k] for k in STEP_TERMS) + work


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="dist_step.py's JSON")
    ap.add_argument("--out", default="bench/out/plan_vs_step.json")
    a = ap.parse_args()
    data = json.loads(Path(a.results).read_text())
    args = argparse.Namespace(**data["args"])
    cfg = model_config(args)
    profile = activation_profile(cfg, gpu=False, dtype=torch.float32)
    rows = []
    head = (f"{'N':>3} {'ckpt':>4} {'peak RSS MiB/rank':>18} {'tracked peak MiB/rank':>22} {'planned MiB/rank':>17} "
            f"{'planned/RSS':>12} {'planned/tracked':>16}")
    print(head + "\n" + "-" * len(head))
    for row in data["rows"]:
        n, ckpt = row["N"], row.get("checkpoint_layers", "off") == "on"
        r = plan(cfg, Workload(args.P, responses=args.G, response_tokens=args.R),
                 Cluster(n, 1e6, zero=row["zero"], precision="fp32"),
                 EngineChoice(chunk=args.prompt_chunk, checkpoint_layers=ckpt, profile=profile))
        planned = planned_step_bytes(r)
        measured = max(row["peak_delta_bytes_per_rank"])
        tracked = max(row.get("tracked_peak_bytes_per_rank") or [None], key=lambda b: b or 0)
        rows.append({"N": n, "checkpoint_layers": ckpt, "measured_bytes": measured, "tracked_bytes": tracked,
                     "planned_bytes": planned})
        ratio = f"{planned / tracked:>16.2f}" if tracked else f"{'-':>16}"
        print(f"{n:>3} {'on' if ckpt else 'off':>4} {measured / MIB:>18.1f} "
              f"{(tracked or 0) / MIB:>22.1f} {planned / MIB:>17.1f} {planned / measured:>12.2f} {ratio}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
