"""Waiting for child processes without a wall-clock bound: a loaded 2-core machine runs them many times slower,
so a wait fails only when the children stop working (no CPU time used by any of their process trees for
`idle_s` seconds: a hang), never because they are slow. Used by the subprocess tests (flows, schedulers) and by
tests/parallel/launch.py's `run_ranks`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

IDLE_S = 120.0  # no test child sits this long without any CPU time unless it hangs
POLL_S = 1.0
# CPU time that is no work: a blocked rank's runtime threads (gloo's, torch's) wake for ~10 ms every few seconds,
# which would reset a short window for ever
NOISE_S = 0.05


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3 first); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, theirs, ...), found by their parent ids in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and all its descendants so far, the children it already reaped
    included (so a child's exit does not lower the sum); 0 where /proc cannot be read."""
    total = 0.0
    for p in [pid, *descendants(pid)]:
        fields = _stat(p)
        if fields is not None:
            with_reaped = fields[11:15]  # utime, stime, cutime, cstime
            total += sum(int(x) for x in with_reaped) / os.sysconf("SC_CLK_TCK")
    return total


class IdleWatch:
    """Tells a hung set of processes from a slow one: `idle(pids)` is True once none of their process trees used
    more than `NOISE_S` of CPU time for `idle_s` seconds."""

    def __init__(self, idle_s: float = IDLE_S):
        self.idle_s = idle_s
        self._cpu: dict[int, float] = {}
        self._progress = time.monotonic()

    def idle(self, pids: Iterable[int]) -> bool:
        cpu = {p: cpu_seconds(p) for p in pids}
        if any(c - self._cpu.get(p, -1.0) > NOISE_S for p, c in cpu.items()):
            self._cpu, self._progress = cpu, time.monotonic()
        return time.monotonic() - self._progress > self.idle_s


def communicate(procs: Sequence[subprocess.Popen], idle_s: float = IDLE_S) -> list[tuple[str, str | None]]:
    """Wait until every process of `procs` has exited, reading its pipes; their (stdout, stderr) in order.
    Raises TimeoutError when none of them used CPU time (their descendants included) for `idle_s` seconds."""
    out: dict[int, tuple[str, str | None]] = {}
    watch = IdleWatch(idle_s)
    while len(out) < len(procs):
        for i, p in enumerate(procs):
            if i not in out:
                try:
                    out[i] = p.communicate(timeout=POLL_S / len(procs))
                except subprocess.TimeoutExpired:  # retrying loses no output (subprocess's docs)
                    pass
        running = [p.pid for i, p in enumerate(procs) if i not in out]
        if running and watch.idle(running):
            raise TimeoutError(f"{[p.args for i, p in enumerate(procs) if i not in out]} used no CPU time for "
                               f"{idle_s:.0f} s and did not exit: a hang")
    return [out[i] for i in range(len(procs))]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`, its process group and every process below it (torchrun starts each rank in a session of its
    own, holding the launcher's pipes), so that its output ends and nothing is left running."""
    if proc.poll() is None:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def run(args: list[str], idle_s: float = IDLE_S, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True, **kwargs)` failing on a hang, not on slowness (see
    `communicate`); the hung process's group (its own session) is killed."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        ((stdout, stderr),) = communicate([proc], idle_s)
    finally:
        kill_tree(proc)
        proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
