"""One exact GRPO step with the prefix state sharded over N ranks (torchrun, gloo on CPU / nccl on GPU).

For each N, `torchrun --standalone --nproc-per-node N` runs this script in its `--worker` role: every rank builds
the same model, runs one warm-up step, then one measured `grpo_backward(mode="exact", parallel=sp)`, and writes
its wall seconds, peak RSS above the RSS before the call, state bytes and the payload it handed to collectives.
The parent prints one row per N with the ratio against N = 1 and checks that the gradient equals N = 1's.

    .venv/bin/python bench/dist_step.py                       # N in {1, 2, 4}, P = 16384, G = 8, tiny dense model
    .venv/bin/python bench/dist_step.py --N 1 2 --P 4096 --arch qwen3_5
    .venv/bin/python bench/dist_step.py --N 1 2 4 --zero 0 3   # also with the parameters sharded (FSDP2, ZeRO-3)
    .venv/bin/python bench/dist_step.py --N 1 2 --zero 3 --order chunks layers   # ZeRO-3: the prompt's two orders
    .venv/bin/python bench/dist_step.py --N 1 2 --hidden 1024 --checkpoint-layers off on   # per-layer checkpointing
    .venv/bin/python bench/dist_step.py --N 1 2 4 --arch glm_moe_dsa --zero 3 --expert-parallel off on   # MoE
    .venv/bin/python bench/dist_step.py --quick               # smoke run, seconds (plan_vs_step.py reads its JSON)

On CPU every rank is one process with `--threads` threads: with more ranks x threads than cores, the ranks
share cores and wall time says little; the state bytes per rank and the traffic do not depend on that.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from archs import ARCHS  # noqa: E402

MIB = 2**20


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import longstraw as ls
    from longstraw.memory import current_bytes, peak_bytes, release_freed, reset_peak
    from longstraw.parallel import SequenceParallel, experts, full_tensor, local_shard, shard_model

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    sp = SequenceParallel()
    torch.manual_seed(0)
    model = ls.build_model(model_config(args))
    if args.zero[0]:  # a worker runs one stage
        shard_model(model, args.zero[0], sp, expert_parallel=args.expert_parallel[0] == "on")
    param_bytes = sum(local_shard(p).nelement() * p.element_size() for p in model.parameters())
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (args.P,), generator=gen)
    responses = [torch.randint(0, vocab, (args.R,), generator=gen) for _ in range(args.G)]
    adv = ls.group_advantages(torch.rand(args.G, generator=gen, dtype=torch.float64))
    cfg = ls.EngineConfig(prompt_chunk=args.prompt_chunk, prompt_graph_budget=0, prompt_order=args.order[0],
                          checkpoint_layers=args.checkpoint_layers[0] == "on")
    ls.grpo_backward(model, prompt[:256], responses[:2], adv[:2] - adv[:2].mean(), engine=cfg, parallel=sp)
    model.zero_grad(set_to_none=True)
    release_freed()
    sp.bytes_communicated = 0
    gathered = [0, 0]  # FSDP's weight all-gathers: calls, bytes received
    plain = dist.all_gather_single

    def counted(output, inp, *a, **kw):
        gathered[0] += 1
        gathered[1] += output.nelement() * output.element_size() - inp.nelement() * inp.element_size()
        return plain(output, inp, *a, **kw)

    dist.all_gather_single = counted  # what FSDP2 gathers parameters with
    routed = [0]  # bytes this rank hands to the experts' all-to-alls (expert parallelism)
    plain_a2a = experts.all_to_all_single_autograd

    def counted_a2a(t, *a, **kw):
        routed[0] += t.nelement() * t.element_size()
        return plain_a2a(t, *a, **kw)

    experts.all_to_all_single_autograd = counted_a2a
    dist.barrier()
    before = current_bytes()
    reset_peak()
    tracker = contextlib.nullcontext()
    if args.track:  # the storages alive at once, as `longstraw plan --rehearse` counts them (slower: a dispatch mode)
        from longstraw.tools.rehearse import LiveBytes

        tracker = LiveBytes("cpu")
        for t in [*model.parameters(), *model.buffers()]:  # there before the step, as RSS's baseline has them
            tracker.ignore(local_shard(t))
    t0 = time.perf_counter()
    with tracker:
        stats = ls.grpo_backward(model, prompt, responses, adv, mode="exact", engine=cfg, parallel=sp)
    wall = time.perf_counter() - t0
    # (parameters no loss reaches, such as DSA's indexer, have none)
    grad = torch.cat([full_tensor(p.grad).flatten() for p in model.parameters() if p.grad is not None])
    out = {"rank": sp.rank, "seconds": wall, "peak_delta_bytes": peak_bytes() - before,
           "tracked_peak_bytes": getattr(tracker, "peak", None),
           "state_bytes": stats["state_bytes"], "peak_state_bytes": stats["peak_state_bytes"],
           "bytes_communicated": sp.bytes_communicated, "param_bytes": param_bytes, "grad_norm": float(grad.norm()),
           "weight_gathers": gathered[0], "weight_gather_bytes": gathered[1], "all_to_all_bytes": routed[0],
           "grad_head": grad[:2048].tolist()}
    Path(args.out_dir, f"rank-{sp.rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    os._exit(0)


def model_config(args: argparse.Namespace) -> dict:
    """The arch's tiny config, widened to `--hidden` (heads of 64, 2 query heads per KV head, MLP 3 x hidden)."""
    cfg = ARCHS[args.arch](args.P + args.R + 8)
    if args.hidden:
        h = args.hidden
        cfg.update(hidden_size=h, intermediate_size=3 * h, num_attention_heads=h // 64,
                   num_key_value_heads=max(1, h // 128), head_dim=64)
    return cfg


def run(n: int, zero: int, order: str, ckpt: str, ep: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               os.path.abspath(__file__), "--worker", "--out-dir", d, "--P", str(args.P), "--G", str(args.G),
               "--R", str(args.R), "--arch", args.arch, "--threads", str(args.threads),
               "--prompt-chunk", str(args.prompt_chunk), "--zero", str(zero), "--order", order,
               "--hidden", str(args.hidden), "--checkpoint-layers", ckpt, "--expert-parallel", ep] + \
            (["--track"] if args.track else [])
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(Path(__file__).parent)}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        files = sorted(Path(d).glob("rank-*.json"))
        if done.returncode or len(files) != n:
            raise RuntimeError(f"N={n} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return [json.loads(f.read_text()) for f in files]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--P", type=int, default=16384)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--arch", default="dense", choices=list(ARCHS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-chunk", type=int, default=2048)
    ap.add_argument("--zero", type=int, nargs="+", default=[0], choices=(0, 2, 3),
                    help="ZeRO stages to run at N > 1 (2, 3: FSDP2 shards parameters and gradients)")
    ap.add_argument("--order", nargs="+", default=["auto"], choices=("auto", "chunks", "layers"),
                    help="EngineConfig.prompt_order values to run at N > 1 (auto: layers under ZeRO-3)")
    ap.add_argument("--hidden", type=int, default=0, help="widen the dense arch to this hidden size (0: as archs.py)")
    ap.add_argument("--checkpoint-layers", nargs="+", default=["off"], choices=("off", "on"),
                    help="EngineConfig.checkpoint_layers values to run (per-layer activation checkpointing)")
    ap.add_argument("--expert-parallel", nargs="+", default=["off"], choices=("off", "on"),
                    help="at N > 1 under ZeRO-2/3, MoE experts split over the ranks whole (on) or gathered by FSDP")
    ap.add_argument("--track", action="store_true", help="also track the live storages of the step (the "
                    "rehearsal's measure; slower)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="bench/out/dist_step.json")
    ap.add_argument("--quick", action="store_true", help="smoke run: N in {1, 2}, P = 256, G = 2, R = 8, chunk 64")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.N, args.P, args.G, args.R, args.prompt_chunk = [1, 2], 256, 2, 8, 64
    print(f"dist_step: arch={args.arch} P={args.P} G={args.G} R={args.R} chunk={args.prompt_chunk} "
          f"threads/rank={args.threads} cores={os.cpu_count()}", flush=True)
    import math

    rows, base = [], None
    head = (f"{'N':>3} {'ZeRO':>4} {'order':>6} {'ckpt':>4} {'EP':>3} {'wall s':>8} {'vs N=1':>7} {'params MiB/rank':>15} {'state MiB/rank':>15} "
            f"{'state+dState MiB/rank':>22} {'peak MiB/rank (max)':>20} {'SP comm MiB/rank':>17} "
            f"{'weight gathers (MiB)':>21} {'all-to-all MiB/rank':>20} {'grad rel err vs N=1':>20}")
    print(head + "\n" + "-" * len(head), flush=True)
    runs = [(n, z, o, c, e) for n in args.N for z in (args.zero if n > 1 else [0])
            for o in (args.order if n > 1 else ["auto"]) for c in args.checkpoint_layers
            for e in (args.expert_parallel if n > 1 and z >= 2 else ["off"])]
    for n, zero, order, ckpt, ep in runs:
        ranks = run(n, zero, order, ckpt, ep, args)
        wall = max(r["seconds"] for r in ranks)
        if base is None:
            base = {**ranks[0], "wall": wall}
        err = math.sqrt(sum((a - b) ** 2 for a, b in zip(ranks[0]["grad_head"], base["grad_head"])))
        err /= math.sqrt(sum(b * b for b in base["grad_head"])) or 1.0
        row = {"N": n, "zero": zero, "order": order, "checkpoint_layers": ckpt, "expert_parallel": ep,
               "wall_seconds": wall, "ratio_vs_1": wall / base["wall"],
               "param_bytes_per_rank": [r["param_bytes"] for r in ranks],
               "state_bytes_per_rank": [r["state_bytes"] for r in ranks],
               "peak_state_bytes_per_rank": [r["peak_state_bytes"] for r in ranks],
               "peak_delta_bytes_per_rank": [r["peak_delta_bytes"] for r in ranks],
               "tracked_peak_bytes_per_rank": [r["tracked_peak_bytes"] for r in ranks],
               "bytes_communicated_per_rank": [r["bytes_communicated"] for r in ranks],
               "weight_gathers": ranks[0]["weight_gathers"], "weight_gather_bytes": ranks[0]["weight_gather_bytes"],
               "all_to_all_bytes_per_rank": [r["all_to_all_bytes"] for r in ranks],
               "grad_rel_err_vs_1_first_2048": err}
        rows.append(row)
        gathers = f"{row['weight_gathers']} ({row['weight_gather_bytes'] / MIB:.1f})"
        print(f"{n:>3} {zero:>4} {order:>6} {ckpt:>4} {ep:>3} {wall:>8.2f} {row['ratio_vs_1']:>7.2f} {max(row['param_bytes_per_rank']) / MIB:>15.2f} "
              f"{max(row['state_bytes_per_rank']) / MIB:>15.2f} {max(row['peak_state_bytes_per_rank']) / MIB:>22.2f} "
              f"{max(row['peak_delta_bytes_per_rank']) / MIB:>20.1f} {max(row['bytes_communicated_per_rank']) / MIB:>17.1f} "
              f"{gathers:>21} {max(row['all_to_all_bytes_per_rank']) / MIB:>20.1f} {err:>20.2e}", flush=True)
    print("SP comm: the payload handed to the sequence-parallel collectives (FSDP's all-gathers and "
          "reduce-scatters come on top); weight gathers: FSDP's all-gathers of one step (rank 0), and MiB received")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
