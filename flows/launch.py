"""Starting a multi-rank run from outside its torchrun job: the one path `longstraw train` (flows/cli.py) and the
`grpo-train` flow called outside a job (a deployment's run, a script; flows/train.py) both take."""

from __future__ import annotations

import time
from dataclasses import dataclass

from longstraw.errors import EXIT_FAULT, EXIT_USER
from longstraw.train import spmd
from longstraw.train.config import TrainConfig
from longstraw.train.lock import RunLock

_LAUNCHED: dict[str, float] = {}  # run dir -> when `launch_ranks` last started its job (its records are newer)


@dataclass(frozen=True)
class LaunchFailure:
    """How a job of `launch_ranks` failed: the line to print last, and the exit status (longstraw/errors.py)."""

    line: str
    code: int


def launch_ranks(cfg: TrainConfig, progress: bool) -> int:
    """Start this node's ranks of the run under torchrun and wait for them; returns the job's exit status (0: it
    finished; negative: torchrun killed by that signal)."""
    # fail now, not after starting the ranks, when another run holds the directory. On several nodes every node
    # checks before it joins the rendezvous, so before rank 0 (wherever it runs) takes the lock for the run
    with RunLock(cfg.run_dir):
        pass
    _LAUNCHED[cfg.run_dir] = time.time()
    return spmd.launch(cfg, progress)


def launch_failure(cfg: TrainConfig, code: int) -> LaunchFailure:
    """What to say last, and the exit status, when the job of `launch_ranks` exited with `code` != 0: the error
    a rank recorded as the cause (spmd.job_failure), with a resume's advice only where a resume fixes it."""
    p = cfg.pipeline
    where = f" (node {p.node_rank} of {p.nnodes})" if p.nnodes > 1 else ""
    resume = f"`longstraw resume {cfg.run_dir}` continues it"
    cause = spmd.job_failure(cfg, _LAUNCHED.get(cfg.run_dir, 0.0))
    if cause is None:  # no rank recorded an error of its own: one was killed or lost (torchrun's line names it)
        return LaunchFailure(f"the {p.nproc}-rank run failed{where} (exit {code}; its ranks' errors are above); "
                             f"{resume}", EXIT_FAULT)
    if cause["kind"] == "user":
        error = cause.get("error", cause["message"])
        return LaunchFailure(f"the {p.nproc}-rank run failed{where}: rank {cause['rank']}: {error}", EXIT_USER)
    message = cause["message"]
    return LaunchFailure(f"the {p.nproc}-rank run failed{where}: {message}"
                         + ("" if "longstraw resume" in message else f"; {resume}"), EXIT_FAULT)


def launch_failed(cfg: TrainConfig, code: int) -> str:
    """What to say when the job of `launch_ranks` exited with `code` != 0 (`launch_failure`'s line)."""
    return launch_failure(cfg, code).line
