"""Local ranks under torch's own launcher: `torchrun`, one command for every multi-rank entry point (the training
run, `longstraw step --nproc`). torchrun starts the processes and gives each its RANK / WORLD_SIZE; nothing here
is a launcher of our own."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun(module: str, args: list[str], nproc: int, threads: int | None = None, **run_kwargs
             ) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc-per-node=N -m module args...`, waited for. Each rank
    runs `threads` torch threads (default: the machine's cores divided among the ranks)."""
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.5", "-m", module, *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, env=env, **run_kwargs)
