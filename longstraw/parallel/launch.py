"""Ranks under torch's own launcher: `torchrun`, one command for every multi-rank entry point (the training run,
`longstraw step --nproc`). torchrun starts the processes and gives each its RANK / WORLD_SIZE; nothing here is a
launcher of our own. One machine: `--standalone`. Several: every machine runs this with the same `nnodes` and
`rdzv_endpoint`, and torchrun's c10d rendezvous there forms one job of `nproc` ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LAUNCHER_PID = "LONGSTRAW_LAUNCHER_PID"  # the process the agent (agent.py) must not outlive
AGENT_DIR = "LONGSTRAW_AGENT_DIR"  # where the ranks of the agent's node say that one of them failed


def rank_failed() -> None:
    """Called by a rank that exits with an error: its agent (agent.py) must end too, even if the rendezvous host
    went silent."""
    d = os.environ.get(AGENT_DIR)
    if d and Path(d).is_dir():
        (Path(d) / f"failed-{os.getpid()}").touch()


def torchrun(module: str, args: list[str], nproc: int, threads: int | None = None, *, nnodes: int = 1,
             rdzv_endpoint: str | None = None, rdzv_id: str = "longstraw", **run_kwargs
             ) -> subprocess.CompletedProcess:
    """`torchrun ... -m module args...` for this machine's nproc / nnodes ranks, waited for (torch's agent, its
    failure report one line, and it ends with this process: `agent.py`). Each rank runs `threads` torch threads
    (default: the machine's cores divided among its ranks)."""
    per_node = nproc // nnodes
    threads = threads or max(1, (os.cpu_count() or 1) // per_node)
    if nnodes == 1 and rdzv_endpoint is None:
        where = ["--standalone"]
    else:
        # c10d: the agent on the endpoint's host serves the rendezvous store; the others connect to it. torchrun
        # numbers the nodes itself here (it ignores --node-rank outside its static rendezvous).
        where = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                 f"--rdzv-id={rdzv_id}"]
    cmd = [sys.executable, "-m", "longstraw.parallel.agent", *where, f"--nproc-per-node={per_node}",
           "--monitor-interval=0.5", "-m", module, *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", LAUNCHER_PID: str(os.getpid())}
    return subprocess.run(cmd, env=env, **run_kwargs)
