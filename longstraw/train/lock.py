"""One run per run directory: an exclusive lock that names its holder.

`flock` on `<run_dir>/.lock`: the kernel drops it when the holding process dies (kill -9 included), so a stale
lock never blocks a resume. The file says who holds it (PID, host, start time) for the error a second run gets.

Several machines: the run directory is shared, and the holder (rank 0) may run on another machine than a second
run's launcher, so liveness is never judged from the PID (it means nothing off its host; nothing here signals or
probes it): only the lock itself says the holder lives. That needs a flock every machine mounting the directory
honours: local disks, NFSv4 (Linux maps flock onto NFS byte-range locks; the server drops a dead client's locks
when its lease expires), Lustre mounted with `-o flock`, CephFS, GPFS; not Lustre's `-o localflock` nor NFS
mounted `nolock`, where a second run on another machine would get the lock too.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ..errors import UserError


class RunDirLocked(UserError, RuntimeError):
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
        # the host with the PID: with the run directory shared, the holder may be on another machine
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
