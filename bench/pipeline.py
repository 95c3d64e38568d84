"""The training pipeline per stage, on N = 1 and N = 2 ranks: seconds, bytes read and written, and what Prefect +
MLflow add on top; and whether storing a group's summed dState would beat replaying its branches again.

Runs `longstraw train --nproc N` (the Prefect flow on rank 0 driving resident ranks, MLflow in sqlite, the zarr
store) for a few steps of a random model in a fresh run directory, then reads the per-stage numbers from the run's
own MLflow nested stage runs: `op_seconds` (wall inside the op, on rank 0) and the bytes all ranks read and wrote
meanwhile (`/proc/self/io` rchar/wchar: page-cache reads count too, which is what a stage asks of storage).
Orchestration = step wall time - the time inside the stages.

dState: the pipeline keeps a group's dLoss/dState in memory between its replay tasks and its prompt backward, so
a resume after a failure there replays the group's branches again. Storing the summed dState instead would cost one
write per group on every step (and a read on resume). This measures both sides at the same P: the replay time of a
group, and writing + reading a state-sized shard with the store the pipeline uses.

    .venv/bin/python bench/pipeline.py                                   # tiny model, P = 256, N = 1 and 2
    .venv/bin/python bench/pipeline.py --model 4x1024 --P 16384 --steps 1
    .venv/bin/python bench/pipeline.py --quick                           # smoke run: one rank, one step
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

STAGES = ("capture", "rollout", "reference", "reward", "replay", "prompt", "optimizer")
MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "4x1024": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64),
}


def model_config(args) -> dict:
    return {"model_type": "qwen3", "vocab_size": 260, "max_position_embeddings": args.P + 64, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, **MODELS[args.model]}


def run(args, nproc: int, d: Path) -> dict:
    """One `longstraw train` run on `nproc` ranks; per-stage totals from its MLflow stage runs."""
    from mlflow import MlflowClient

    from longstraw.train.config import TrainConfig

    cfg = TrainConfig.model_validate(dict(
        model={"random": model_config(args)}, prompt_tokens=args.P, steps=args.steps, groups=1, responses=args.G,
        max_new_tokens=8, reward="digit_overlap", run_dir=str(d / "run"),
        engine={"prompt_chunk": args.chunk, "prompt_graph_budget": args.graph_budget},
        threads=1, pipeline={"nproc": nproc, "branches_per_task": 1, "retries": 0}))
    (d / "cfg.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    env = {**os.environ, "PREFECT_HOME": str(d / "prefect"), "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config", str(d / "cfg.yaml"),
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"the {nproc}-rank run failed:\n{done.stderr[-3000:]}")
    client = MlflowClient(tracking_uri=f"sqlite:///{d / 'run' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("longstraw").experiment_id])
    totals: dict = defaultdict(lambda: {"calls": 0, "seconds": 0.0, "read": 0, "written": 0})
    for r in runs:
        stage = r.data.tags.get("stage")
        if stage in STAGES:
            t, m = totals[stage], r.data.metrics
            t["calls"] += 1
            t["seconds"] += m.get("op_seconds", 0.0)
            t["read"] += m.get("read_bytes", 0.0)
            t["written"] += m.get("written_bytes", 0.0)
    history = json.loads((d / "run" / "history.json").read_text())
    step_wall = sum(h["step_seconds"] for h in history)
    inside = sum(t["seconds"] for t in totals.values())
    return {"nproc": nproc, "wall": wall, "stages": dict(totals), "step_seconds": step_wall,
            "inside_stages_seconds": inside, "orchestration_share": (step_wall - inside) / step_wall,
            "state_bytes": history[-1]["prefix_state_bytes"], "replay_seconds_per_step": totals["replay"]["seconds"]
            / len(history)}


def dstate_io(args, d: Path) -> dict:
    """Seconds to write and to read back (checksums verified) one state-sized shard: the cost of storing dState."""
    import torch

    import longstraw as ls
    from longstraw.sharded_state import commit_sharded_state, load_state_shard, save_state_shard

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ls.build_model(model_config(args))
    state = ls.capture(model, torch.randint(0, 260, (args.P,)), ls.EngineConfig(prompt_chunk=args.chunk))
    t0 = time.perf_counter()
    rec = save_state_shard(state, str(d / "dstate"), 0, weights_version="w")
    commit_sharded_state(str(d / "dstate"), [rec], state=state, weights_version="w")
    write = time.perf_counter() - t0
    t0 = time.perf_counter()
    load_state_shard(str(d / "dstate"), 0, 1, model=model, weights_version="w")
    return {"bytes": state.nbytes, "write_seconds": write, "read_seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="tiny")
    ap.add_argument("--P", type=int, default=256, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--graph-budget", type=int, default=None,
                    help="engine.prompt_graph_budget in bytes (default: a quarter of free memory; 0 recomputes every chunk)")
    ap.add_argument("--out", default="bench/out/pipeline.json")
    ap.add_argument("--quick", action="store_true", help="smoke run: N = 1, G = 2, one step")
    args = ap.parse_args()
    if args.quick:
        args.nproc, args.G, args.steps = [1], 2, 1

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.nproc:
            d = Path(tmp) / f"n{n}"
            d.mkdir()
            results.append(run(args, n, d))
        io = dstate_io(args, Path(tmp))
    print(f"pipeline: model {args.model}, P = {args.P}, G = {args.G}, {args.steps} steps, chunk {args.chunk}")
    for r in results:
        print(f"\nN = {r['nproc']}: {r['wall']:.1f} s in all (torchrun, Prefect and MLflow start included)")
        print(f"{'stage':<10} {'calls':>5} {'seconds':>8} {'s/call':>7} {'MiB read':>9} {'MiB written':>12}")
        for name in STAGES:
            if name in r["stages"]:
                t = r["stages"][name]
                print(f"{name:<10} {t['calls']:>5} {t['seconds']:>8.2f} {t['seconds'] / t['calls']:>7.2f} "
                      f"{t['read'] / 2**20:>9.1f} {t['written'] / 2**20:>12.1f}")
        overhead = r["step_seconds"] - r["inside_stages_seconds"]
        print(f"steps: {r['step_seconds']:.2f} s, inside stages {r['inside_stages_seconds']:.2f} s, orchestration "
              f"(Prefect + MLflow + commands) {overhead:.2f} s = {r['orchestration_share']:.0%} of step time")
    rep = results[0]["replay_seconds_per_step"]
    print(f"\ndState of one group ({io['bytes'] / 2**20:.1f} MiB): store {io['write_seconds']:.2f} s every step "
          f"(+ {io['read_seconds']:.2f} s to read on resume) vs replaying the group's branches again on resume "
          f"{rep:.2f} s (N = {results[0]['nproc']})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": results, "dstate_io": io}, indent=1))


if __name__ == "__main__":
    main()
