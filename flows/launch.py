"""Starting a multi-rank run from outside its torchrun job: the one path `longstraw train` (flows/cli.py) and the
`grpo-train` flow called outside a job (a deployment's run, a script; flows/train.py) both take."""

from __future__ import annotations

import time
from dataclasses import dataclass

from longstraw.errors import EXIT_FAULT, EXIT_USER
from longstraw.train import spmd
from longstraw.train.config import TrainConfig
from longstraw.train.lock import RunLock


@dataclass(frozen=True)
class LaunchFailure:
    """How a job of `launch_ranks` failed: the line to print last, and the exit status (longstraw/errors.py)."""

    line: str
    code: int


def launch_ranks(cfg: TrainConfig, progress: bool) -> LaunchFailure | None:
    """Start this node's ranks of the run under torchrun and wait for them; None when the job finished, else how
    it failed."""
    # fail now, not after starting the ranks, when another run holds the directory. On several nodes every node
    # checks before it joins the rendezvous, so before rank 0 (wherever it runs) takes the lock for the run
    with RunLock(cfg.run_dir):
        pass
    started = time.time()  # the job's error records are newer
    code = spmd.launch(cfg, progress)
    return launch_failure(cfg, code, started) if code else None


def launch_failure(cfg: TrainConfig, code: int, started: float) -> LaunchFailure:
    """What to say last, and the exit status, when the job started at `started` exited with `code` != 0 (negative:
    torchrun killed by that signal): the error a rank recorded as the cause (spmd.job_failure), with a resume's
    advice only where a resume fixes it."""
    p = cfg.pipeline
    where = f" (node {p.node_rank} of {p.nnodes})" if p.nnodes > 1 else ""
    resume = f"`longstraw resume {cfg.run_dir}` continues it"
    cause = spmd.job_failure(cfg, started)
    if cause is None:  # no rank recorded an error of its own: one was killed or lost (torchrun's line names it)
        return LaunchFailure(f"the {p.nproc}-rank run failed{where} (exit {code}; its ranks' errors are above); "
                             f"{resume}", EXIT_FAULT)
    if cause["kind"] == "user":
        error = cause.get("error", cause["message"])
        return LaunchFailure(f"the {p.nproc}-rank run failed{where}: rank {cause['rank']}: {error}", EXIT_USER)
    message = cause["message"]
    return LaunchFailure(f"the {p.nproc}-rank run failed{where}: {message}"
                         + ("" if "longstraw resume" in message else f"; {resume}"), EXIT_FAULT)

