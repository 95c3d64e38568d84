"""The training pipeline per stage: seconds, bytes read and written, and what Prefect + MLflow add on top.

Runs `grpo_train` (the Prefect flow, MLflow in sqlite, the zarr store) for a few steps of a random model and
wraps every library stage to measure it: wall seconds inside the stage, and the bytes the process read and
wrote meanwhile (`/proc/self/io` rchar/wchar: reads served from the page cache count too, which is what a stage
asks of storage). Stages run one at a time (`replay_concurrency: 1`) so that the counters belong to one stage.
Orchestration = step wall time - the time inside stages.

    .venv/bin/python bench/pipeline.py                      # tiny model (2 layers, hidden 64), P = 256
    .venv/bin/python bench/pipeline.py --model 4x1024 --P 16384 --steps 1

N = 1 only: the pipeline has no multi-rank path yet (issue 12).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

STAGES = ("init_run", "capture_stage", "rollout_stage", "reference_stage", "reward_stage", "replay_stage",
          "prompt_stage", "optimizer_stage")
MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "4x1024": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64),
}


def _io() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def instrument(lib) -> dict:
    """Wrap the library's stage functions (the Prefect tasks look them up at call time)."""
    totals: dict = defaultdict(lambda: {"calls": 0, "seconds": 0.0, "read": 0, "written": 0})
    for name in STAGES:
        fn = getattr(lib, name)

        def timed(*a, _fn=fn, _name=name, **kw):
            r0, w0 = _io()
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                r1, w1 = _io()
                t = totals[_name]
                t["calls"] += 1
                t["seconds"] += time.perf_counter() - t0
                t["read"] += r1 - r0
                t["written"] += w1 - w0

        setattr(lib, name, timed)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="tiny")
    ap.add_argument("--P", type=int, default=256, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--out", default="bench/out/pipeline.json")
    args = ap.parse_args()

    import longstraw.train.stages as lib
    from flows.train import grpo_train
    from longstraw.train.config import TrainConfig

    totals = instrument(lib)
    with tempfile.TemporaryDirectory() as d:
        model = {"model_type": "qwen3", "vocab_size": 260, "max_position_embeddings": args.P + 64,
                 "rms_norm_eps": 1e-6, "tie_word_embeddings": False, **MODELS[args.model]}
        cfg = TrainConfig.model_validate(dict(
            model={"random": model}, prompt_tokens=args.P, steps=args.steps, groups=1, responses=args.G,
            max_new_tokens=8, reward="digit_overlap", grpo={"prompt_chunk": args.chunk}, run_dir=f"{d}/run",
            threads=1, pipeline={"replay_concurrency": 1, "branches_per_task": 1, "retries": 0}))
        t0 = time.perf_counter()
        out = grpo_train(cfg.model_dump(mode="json"), progress=False)
        wall = time.perf_counter() - t0
    steps = out["history"]
    step_wall = sum(h["step_seconds"] for h in steps)
    inside = sum(t["seconds"] for name, t in totals.items() if name != "init_run")
    print(f"pipeline: model {args.model}, P = {args.P}, G = {args.G}, {args.steps} steps, chunk {args.chunk}, "
          f"one stage at a time; {wall:.1f} s in all")
    print(f"{'stage':<16} {'calls':>5} {'seconds':>8} {'s/call':>7} {'MiB read':>9} {'MiB written':>12}")
    for name in STAGES:
        if name in totals:
            t = totals[name]
            print(f"{name:<16} {t['calls']:>5} {t['seconds']:>8.2f} {t['seconds'] / t['calls']:>7.2f} "
                  f"{t['read'] / 2**20:>9.1f} {t['written'] / 2**20:>12.1f}")
    overhead = step_wall - inside
    print(f"steps: {step_wall:.2f} s, inside stages {inside:.2f} s, orchestration (Prefect + MLflow) "
          f"{overhead:.2f} s = {overhead / step_wall:.0%} of step time")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "stages": dict(totals), "step_seconds": step_wall,
                                          "inside_stages_seconds": inside, "orchestration_share": overhead / step_wall},
                                         indent=1))


if __name__ == "__main__":
    main()
