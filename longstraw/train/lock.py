"""One run per run directory: an exclusive lock that names its holder.

`flock` on `<run_dir>/.lock`: the kernel drops it when the holding process dies (kill -9 included), so a stale
lock never blocks a resume. The file says who holds it (PID, host, start time) for the error a second run gets.
On filesystems without working flock (some NFS set-ups) use a local run directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path


class RunDirLocked(RuntimeError):
    """Another process holds the run directory."""


class RunLock:
    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self._file = None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # not "w": the holder's record must survive a failed attempt
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "{}"
            f.close()
            try:
                who = json.loads(holder)
            except json.JSONDecodeError:
                who = {}
            raise RunDirLocked(
                f"run directory {self.path.parent} is in use by PID {who.get('pid', '?')} on host "
                f"{who.get('host', '?')} (since {who.get('since', '?')}; lock {self.path}); wait for that run to end "
                f"or stop it, or use another --run-dir") from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}))
        f.flush()
        self._file = f
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.truncate(0)
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
