"""Run a function on N gloo ranks (spawned processes, one thread each) and collect what each returns.

Each rank returns a dict of tensors, sent back as safetensors bytes. A rank that raises sends its traceback;
the parent raises it. Every rank destroys its process group and leaves with os._exit, so gloo's teardown at
interpreter exit cannot turn a passed run into a crash. The ranks start with OMP_NUM_THREADS=1, so no OpenMP pool
of another size is made at import (before `set_num_threads(1)`) and left running into the exit.

No fixed wall-clock bound (a loaded 2-core machine runs these many times slower): the parent fails at once when a
rank dies without reporting, and when no unreported rank has used CPU time for `timeout` seconds (a hang).
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load, save

from tests.progress import IdleWatch

# a peer still importing or descheduled on a loaded machine is slow, not hung: the parent's CPU-time check
# finds real hangs
COLLECTIVE_TIMEOUT = timedelta(seconds=600)
POLL_S = 2.0


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


def _nothing_pending(queue) -> bool:
    """True when nothing more arrives on `queue` within a few seconds (a rank's last message may still be in the
    pipe when its exit is seen)."""
    time.sleep(5 * POLL_S)
    return queue.empty()


class RankKilled(RuntimeError):
    """A rank died by a signal before sending its result."""


class RendezvousFailed(RuntimeError):
    """gloo's rendezvous on loopback failed ("connectFullMesh ... Connection closed by peer"), before any rank ran
    the test's function."""


def run_ranks(world: int, fn, *args, timeout: float = 120.0) -> list[dict[str, torch.Tensor]]:
    """fn(rank, world, *args) -> dict of tensors on each of `world` ranks; their results in rank order.
    `timeout`: seconds without progress (no CPU time used by a rank that has not reported) before failing.

    A rank killed by a signal is run again once, all ranks afresh, with a warning: a rare glibc abort
    ("malloc(): unaligned tcache chunk") in a gloo rank on CPU, not reproduced alone and not yet found, would
    otherwise fail a test whose assertions never ran. A second kill fails the test."""
    try:
        return _run_ranks_rendezvous_retried(world, fn, args, timeout)
    except RankKilled as e:
        warnings.warn(f"{e}; running the ranks once more", stacklevel=2)
        return _run_ranks_rendezvous_retried(world, fn, args, timeout)


def _run_ranks_rendezvous_retried(world: int, fn, args: tuple, timeout: float) -> list[dict[str, torch.Tensor]]:
    """`_run_ranks_once`, run again once when the ranks' rendezvous failed (seen once on torch 2.11, in the run
    after a rank's abort): the test's function never ran."""
    try:
        return _run_ranks_once(world, fn, args, timeout)
    except RendezvousFailed as e:
        warnings.warn(f"{e}; running the ranks once more", stacklevel=3)
        return _run_ranks_once(world, fn, args, timeout)


def _run_ranks_once(world: int, fn, args: tuple, timeout: float) -> list[dict[str, torch.Tensor]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # what the spawned ranks inherit
    try:
        for p in procs:
            p.start()
    finally:
        if omp is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    results, errors = {}, {}
    try:
        watch = IdleWatch(timeout)
        while len(results) + len(errors) < world:
            try:
                rank, err, blob = queue.get(timeout=POLL_S)
            except queue_module.Empty:
                waiting = [r for r in range(world) if r not in results and r not in errors]
                dead = {r: procs[r].exitcode for r in waiting if procs[r].exitcode is not None}
                if dead and _nothing_pending(queue):  # (what it sent before exiting is read first)
                    killed = all(code < 0 for code in dead.values())
                    raise (RankKilled if killed else RuntimeError)(
                        f"ranks {sorted(dead)} of {world} exited without a result (exit codes {dead}; negative: "
                        "killed by that signal, e.g. -6 an abort in malloc)")
                if watch.idle(procs[r].pid for r in waiting):
                    raise TimeoutError(f"ranks {waiting} of {world} used no CPU time for {timeout:.0f} s and sent "
                                       f"no result (a hang, e.g. a collective one rank never called); "
                                       f"reported: {sorted(results)}, failed: {sorted(errors)}")
                continue
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
        failed = "\n".join(f"rank {r} of {world} failed:\n{e}" for r, e in sorted(errors.items()))
        rendezvous = all("connectFullMesh failed" in e and "init_process_group" in e for e in errors.values())
        raise (RendezvousFailed if rendezvous else RuntimeError)(failed)
    return [results[r] for r in range(world)]
