"""Run a function on N gloo ranks (spawned processes, one thread each) and collect what each returns.

Each rank returns a dict of tensors, sent back as safetensors bytes. A rank that raises sends its traceback;
the parent raises it. Every rank destroys its process group and leaves with os._exit, so gloo's teardown at
interpreter exit cannot turn a passed run into a crash; the parent kills what is left after `timeout` seconds.
"""

from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load, save

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args: tuple, queue) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        out = fn(rank, world, *args)
        queue.put((rank, None, save({k: v.detach().contiguous().cpu() for k, v in (out or {}).items()})))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc(), None))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        queue.close()
        queue.join_thread()
        os._exit(code)


def run_ranks(world: int, fn, *args, timeout: float = 120.0) -> list[dict[str, torch.Tensor]]:
    """fn(rank, world, *args) -> dict of tensors on each of `world` ranks; their results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world):
            rank, err, blob = queue.get(timeout=timeout)
            if err is not None:
                errors[rank] = err
            else:
                results[rank] = load(blob)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        queue.close()
        queue.join_thread()
    if errors:
        raise RuntimeError("\n".join(f"rank {r} of {world} failed:\n{e}" for r, e in sorted(errors.items())))
    return [results[r] for r in range(world)]
