"""A ZeRO-3 model loaded on N ranks two ways, from the same HF checkpoint:

- `every rank`: each rank runs `load_model` (the whole model) and then `shard_model`, as the worker did before;
- `rank 0`: rank 0 runs `load_model`, every rank builds the model on the meta device, and `shard_from_rank0`
  broadcasts each rank its shards (what the training worker does now under ZeRO-2/3).

Per rank it prints the peak resident memory the load added (VmHWM, reset before the load, over VmRSS then), the
bytes of weight files the rank opened, and the seconds; and checks that both ways give the same weights. gloo, one
thread per rank.

    .venv/bin/python bench/sharded_load.py                      # 4 x 2048 dense, vocab 32000, bf16, N = 2
    .venv/bin/python bench/sharded_load.py --N 2 4 --layers 8
    .venv/bin/python bench/sharded_load.py --quick              # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_module
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import longstraw as ls  # noqa: E402
import longstraw.models.checkpoint as ckpt  # noqa: E402
from longstraw.models import load_model, meta_model, write_weights  # noqa: E402
from longstraw.parallel import ONE_RANK, shard_from_rank0, shard_model  # noqa: E402

WAYS = ("every rank", "rank 0")


def _status(field: str) -> int:
    """A size from /proc/self/status, in bytes (VmRSS: now; VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS (ru_maxrss would include the fork's)


def _rank(rank: int, world: int, port: int, path: str, way: str, dtype: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    dtype = getattr(torch, dtype)
    opened: list[int] = []
    read = ckpt.iter_tensors
    ckpt.iter_tensors = lambda p, *a, **kw: (opened.append(Path(p).stat().st_size if Path(p).is_file() else sum(
        f.stat().st_size for f in Path(p).glob("*.safetensors"))), read(p, *a, **kw))[1]
    dist.barrier()
    _reset_peak()
    before, t0 = _status("VmRSS"), time.perf_counter()
    if way == "every rank":
        model = shard_model(load_model(path, dtype=dtype), 3)
    else:
        full = load_model(path, dtype=dtype).state_dict() if rank == 0 else None
        model = shard_from_rank0(meta_model(path, dtype), full, 3, ONE_RANK, torch.device("cpu"))
        del full
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - before
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    digest = sum(float(p.detach().to_local().double().sum()) for p in model.parameters())
    queue.put({"rank": rank, "peak_added_mb": peak / 2**20, "opened_mb": sum(opened) / 2**20,
               "shard_mb": shard / 2**20, "seconds": seconds, "checksum": digest})
    dist.destroy_process_group()
    queue.close()
    queue.join_thread()  # flushed before os._exit (gloo can abort at a normal exit)
    os._exit(0)


def _run(world: int, path: str, way: str, dtype: str) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, path, way, dtype, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = []
    while len(out) < world:  # a rank that died (a traceback on stderr) fails the run now, not after a timeout
        try:
            out.append(queue.get(timeout=5))
        except queue_module.Empty:
            dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{way!r} load on {world} ranks: ranks exited with codes {dead} (see stderr)")
    for p in procs:
        p.join(30)
    return sorted(out, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--N", type=int, nargs="+", default=[2])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="bench/out/sharded_load.json")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 layers x 256, vocab 1024, N = 2")
    args = ap.parse_args(argv)
    if args.quick:
        args.N, args.hidden, args.layers, args.vocab = [2], 256, 2, 1024
    cfg = {"model_type": "qwen3", "vocab_size": args.vocab, "hidden_size": args.hidden,
           "intermediate_size": args.hidden * 11 // 4, "num_hidden_layers": args.layers,
           "num_attention_heads": args.hidden // 128, "num_key_value_heads": max(1, args.hidden // 512),
           "head_dim": 128, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "tie_word_embeddings": False}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = ls.build_model(cfg, dtype=getattr(torch, args.dtype))
        params = sum(p.numel() for p in model.parameters())
        write_weights(model, tmp)
        del model
        file_mb = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors")) / 2**20
        print(f"dense {args.layers} x {args.hidden}, vocab {args.vocab}: {params / 1e6:.0f}M parameters, "
              f"{file_mb:.0f} MiB of {args.dtype} in model.safetensors; ZeRO-3, gloo, one thread per rank")
        print(f"{'N':>2} {'way':>10} {'rank':>4} {'peak added MiB':>14} {'opened MiB':>10} {'shard MiB':>9} "
              f"{'seconds':>7}")
        for world in args.N:
            sums = {}
            for way in WAYS:
                for r in _run(world, tmp, way, args.dtype):
                    rows.append({"N": world, "way": way, **r})
                    sums.setdefault(way, []).append(r["checksum"])
                    print(f"{world:>2} {way:>10} {r['rank']:>4} {r['peak_added_mb']:>14.0f} {r['opened_mb']:>10.0f} "
                          f"{r['shard_mb']:>9.0f} {r['seconds']:>7.2f}")
            if sums["every rank"] != sums["rank 0"]:
                raise SystemExit(f"N = {world}: the two ways loaded different weights: {sums}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": cfg, "dtype": args.dtype, "rows": rows}, indent=1))
    print(f"same weights both ways; JSON in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
