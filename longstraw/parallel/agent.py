"""torchrun's agent (`torch.distributed.run`, its own arguments and behaviour) with two changes for a launcher
that waits on it (`launch.torchrun` starts this module instead of `torch.distributed.run`):
- its failure report is one line. The failed rank has printed its error already; torchrun would then print the
  traceback of its own `ChildFailedError` and a box of the failures, which say nothing more to a user;
- it ends with its launcher. Killed alone (kill -9 of `longstraw train`), the launcher would leave the agent and
  its ranks running unwatched; the kernel sends the agent SIGTERM instead (Linux's parent-death signal), and the
  agent stops its ranks as it does on any SIGTERM."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from .launch import LAUNCHER_PID

PR_SET_PDEATHSIG = 1


def _end_with_launcher() -> None:
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(launcher):  # it died before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    _end_with_launcher()
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
        print(f"torchrun: rank {rank} (pid {failure.pid}) ended first, with {how}", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        print(f"torchrun: stopped its ranks on {e.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
