"""torchrun's agent (`torch.distributed.run`, its own arguments and behaviour) with four changes for a launcher
that waits on it (`launch.torchrun` starts this module instead of `torch.distributed.run`):
- its failure report is one line. The failed rank has printed its error already; torchrun would then print the
  traceback of its own `ChildFailedError` and a box of the failures, which say nothing more to a user;
- it ends with its launcher. Killed alone (kill -9 of `longstraw train`), the launcher would leave the agent and
  its ranks running unwatched; the kernel sends the agent SIGTERM instead (Linux's parent-death signal), and the
  agent stops its ranks as it does on any SIGTERM;
- it ends after a rank of its node failed, even when the rendezvous host went silent. torchrun's agent talks to
  that machine's store after its ranks end, and a silent one (powered off, partitioned) leaves it blocked for
  good: the store client has no read timeout. A failing rank says so (`launch.rank_failed`); the agent then
  leaves on its own `STUCK_AFTER_S` later, if torch's shutdown has not ended it by then;
- nothing its ranks started outlives the job. A rank killed with SIGKILL runs no exit handler: its children (the
  temporary Prefect server of rank 0's flow, any other server or helper) would be re-parented to PID 1 and run on.
  The agent is their subreaper (Linux's PR_SET_CHILD_SUBREAPER): they are re-parented to it instead, and it
  stops whatever is left of them when its ranks have ended (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from .launch import AGENT_DIR, LAUNCHER_PID

# torch's own shutdown after a failure takes a second or two with a store that answers, and stops the node's
# ranks within its 30 s shutdown timeout (SIGTERM, then SIGKILL)
STUCK_AFTER_S = 40.0
ORPHANS_STOP_S = 5.0  # how long the ranks' orphans get to end on SIGTERM (Prefect's server stops in < 1 s)
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def _children() -> list[int]:
    """This process's children, from /proc (after its ranks ended: the ranks' orphans, re-parented here)."""
    me, out = os.getpid(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                    out.append(int(entry.name))
    return out


def _reap(pids: list[int]) -> list[int]:
    """Reap those of `pids` that ended; the ones still running."""
    running = []
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if not done:
            running.append(pid)
    return running


def _stop_orphans() -> None:
    """Stop what the ranks left running (their own children re-parented here), and reap it. Grandchildren that a
    stopped orphan leaves are re-parented here too, and found by the next round."""
    if not sys.platform.startswith("linux"):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _children()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + ORPHANS_STOP_S
        while (pids := _reap(_children())) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pids:
            return


def _end_with_launcher() -> None:
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(launcher):  # it died before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)


def _watch(d: Path) -> None:
    """A thread: once a rank said it failed, leave `STUCK_AFTER_S` later (the main thread may be blocked in C)."""
    while not any(d.glob("failed-*")):
        time.sleep(0.5)
    time.sleep(STUCK_AFTER_S)
    print(f"torchrun: a rank of this node failed {STUCK_AFTER_S:g} s ago and the agent has not ended: the "
          "rendezvous host does not answer; leaving", file=sys.stderr, flush=True)
    shutil.rmtree(d, ignore_errors=True)
    _stop_orphans()
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    _end_with_launcher()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    d = Path(tempfile.mkdtemp(prefix="longstraw-agent-"))
    os.environ[AGENT_DIR] = str(d)  # the ranks inherit the agent's environment
    threading.Thread(target=_watch, args=(d,), name="longstraw-agent-watch", daemon=True).start()
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
    finally:
        shutil.rmtree(d, ignore_errors=True)
        _stop_orphans()  # torch has stopped and reaped the ranks by now: what is left are their orphans
    return 0


if __name__ == "__main__":
    sys.exit(main())
