"""Every rank of a multi-rank run runs `run_rank`: `longstraw train --nproc N` starts N of `python -m flows.ranks`
under torchrun, and `longstraw train` started under torchrun (infra/launch.sh) comes here too.

Rank 0 runs the `grpo-train` flow, which drives the others; ranks 1..N-1 build their resident worker and execute
rank 0's commands until it says stop (longstraw/train/spmd.py). Every rank leaves through `os._exit`: gloo's
teardown at interpreter exit can turn a finished run into a crash, so the exit handlers run first. The job's
exit status is rank 0's (on several nodes, each node's torchrun exits 1 when the job failed).
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys

from longstraw.parallel.launch import rank_failed
from longstraw.train.config import TrainConfig


def run_rank(cfg: TrainConfig, progress: bool = True) -> None:
    """This process's part of the job; never returns."""
    from longstraw.train import spmd

    code = 1
    try:
        ranks = spmd.init_ranks(cfg)
        if ranks.leader:
            from .report import report
            from .train import grpo_train

            report(grpo_train(cfg.model_dump(mode="json"), progress=progress))
            code = 0
        else:
            from longstraw.train.worker import Worker

            code = 0
            try:
                spmd.serve(Worker(cfg, ranks))
            except spmd.LeaderLost:
                code = 1  # printed and recorded; nobody else reports it, and torchrun then stops a stalled rank 0
            except spmd.RankFailed:
                # printed and recorded; rank 0 reports it. Beside rank 0 exit 0 (torchrun would stop rank 0 on a
                # failed local worker); on another node exit 1, so that the scheduler sees this node fail too
                code = 0 if ranks.beside_leader else 1
    except BaseException as e:  # noqa: BLE001 - printed here; the status goes to torchrun
        print(f"longstraw: rank {os.environ.get('RANK', '?')}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    finally:
        spmd.shutdown()
        atexit._run_exitfuncs()  # what a normal exit runs (Prefect stops its temporary server, MLflow flushes)
        sys.stdout.flush()
        sys.stderr.flush()
    if code:
        rank_failed()  # torchrun's agent must end too, even if the rendezvous host went silent
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flows.ranks")
    p.add_argument("--config-json", required=True, help="the run's TrainConfig as JSON")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    run_rank(TrainConfig.model_validate_json(args.config_json), progress=not args.no_progress)


if __name__ == "__main__":
    main()
