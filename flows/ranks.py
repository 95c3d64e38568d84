"""Every rank of a multi-rank run runs `run_rank`: `longstraw train --nproc N` starts N of `python -m flows.ranks`
under torchrun, and `longstraw train` started under torchrun (infra/launch.sh) comes here too.

Rank 0 runs the `grpo-train` flow, which drives the others; ranks 1..N-1 build their resident worker and execute
rank 0's commands until it says stop (longstraw/train/spmd.py). Every rank leaves through `os._exit`: gloo's
teardown at interpreter exit can turn a finished run into a crash, so the exit handlers run first. The job's
exit status is rank 0's (on several nodes, each node's torchrun exits 1 when the job failed).

A rank's error is recorded with its kind before the rank tears its groups down (spmd.record_error), so that the
other ranks and the launcher name it, not the rank's leaving; a user's error exits 2 (longstraw/errors.py).
When a rank dies, torchrun sends the others SIGTERM and kills them 30 s later: each rank leaves at once instead
(`_leave_on_sigterm`), without Prefect's crash handling, which talks to a server that got the same signal.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import socket
import sys
import threading

from longstraw.errors import EXIT_FAULT, EXIT_USER
from longstraw.parallel.launch import rank_failed
from longstraw.train.config import TrainConfig

EXIT_HANDLERS_S = 3.0  # the most a rank stopped by SIGTERM waits for its exit handlers (the agent stops what is left)


_stopping = threading.Event()  # SIGTERM came: the main thread's error after it is its effect, not a cause


def _leave_on_sigterm() -> None:
    """On SIGTERM, leave within seconds, whatever the main thread is doing. A Python signal handler runs only in
    the main thread, between bytecodes: blocked in a collective or in Prefect's crash handling (which retries a
    temporary server that got the signal too), it would run only after torchrun's 30 s grace. The C-level handler
    also writes the signal's number to the wakeup fd, which a thread reads; it runs the exit handlers (Prefect
    stops its temporary server) and exits. The process groups go with the process: its peers see the connections
    close. A Python-level handler must be installed for the wakeup fd to be written: Prefect's, while it runs a
    flow, else the no-op here."""
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    try:
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.set_wakeup_fd(theirs.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread (run_rank called from a test): torchrun's SIGTERM as before
        return
    # `theirs` goes with the thread's arguments: closed, it would end the watch at once
    threading.Thread(target=_watch_sigterm, args=(ours, theirs), name="longstraw-sigterm", daemon=True).start()


def _watch_sigterm(ours: socket.socket, theirs: socket.socket) -> None:
    while (got := ours.recv(1))[:1] != bytes([signal.SIGTERM]):
        if not got:
            return
    _stopping.set()
    print(f"longstraw: rank {os.environ.get('RANK', '?')}: stopped by SIGTERM (torchrun stops every rank once one "
          "has ended, or the job was stopped)", file=sys.stderr, flush=True)
    threading.Timer(EXIT_HANDLERS_S, os._exit, (128 + signal.SIGTERM,)).start()  # a handler that hangs
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)


def run_rank(cfg: TrainConfig, progress: bool = True) -> None:
    """This process's part of the job; never returns."""
    from longstraw.train import spmd

    _leave_on_sigterm()
    code = EXIT_FAULT
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
            except spmd.RankFailed:  # this rank's error, or rank 0's (`_leader_lost`)
                # printed and recorded; rank 0 reports it. Beside rank 0 exit 0 (torchrun would stop rank 0 on a
                # failed local worker); on another node exit 1, so that the scheduler sees this node fail too
                code = 0 if ranks.beside_leader else 1
    except BaseException as e:  # noqa: BLE001 - printed here; the status goes to torchrun
        if not isinstance(e, spmd.RankFailed) and not _stopping.is_set():  # RankFailed: recorded where it failed
            spmd.record_error(cfg, e)  # before the groups go down: the others then name it
        code = EXIT_USER if spmd.error_kind(e) == "user" else EXIT_FAULT
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
