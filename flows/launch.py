"""Starting a multi-rank run from outside its torchrun job: the one path `longstraw train` (flows/cli.py) and the
`grpo-train` flow called outside a job (a deployment's run, a script; flows/train.py) both take."""

from __future__ import annotations

from longstraw.train import spmd
from longstraw.train.config import TrainConfig
from longstraw.train.lock import RunLock


def launch_ranks(cfg: TrainConfig, progress: bool) -> int:
    """Start this node's ranks of the run under torchrun and wait for them; returns the job's exit status (0: it
    finished; negative: torchrun killed by that signal)."""
    # fail now, not after starting the ranks, when another run holds the directory. On several nodes every node
    # checks before it joins the rendezvous, so before rank 0 (wherever it runs) takes the lock for the run
    with RunLock(cfg.run_dir):
        pass
    return spmd.launch(cfg, progress)


def launch_failed(cfg: TrainConfig, code: int) -> str:
    """What to say when the job of `launch_ranks` exited with `code` != 0."""
    p = cfg.pipeline
    where = f" (node {p.node_rank} of {p.nnodes})" if p.nnodes > 1 else ""
    return (f"the {p.nproc}-rank run failed{where} (exit {code}; its ranks' errors are above); `longstraw resume "
            f"{cfg.run_dir}` continues it")
