"""What kind of failure an error is: it decides the last line a user sees and the exit status (docs/failures.md).

- `EXIT_FAULT` (1): the job stopped by a fault a resume fixes (a lost or killed rank, a timeout, a transient I/O
  error); the last line ends with `longstraw resume <run dir>`.
- `EXIT_USER` (2): an error the user must fix first (the config, the input files, the model, a corrupted
  checkpoint, a locked run dir, a full or read-only disk); the last line names it and the fix, and never advises a
  resume, which would fail the same way.
"""

from __future__ import annotations

import errno

EXIT_FAULT, EXIT_USER = 1, 2

# I/O errors that a retry or a resume repeats until someone frees space or fixes permissions
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class UserError(Exception):
    """An error the user must fix before running again: its message names the problem and the fix."""


def permanent_os_error(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in PERMANENT_ERRNOS


def is_user_error(e: BaseException) -> bool:
    """Input, config, lock or disk errors (ValueError covers pydantic's ValidationError and CorruptArtefact)."""
    return isinstance(e, (UserError, ValueError, FileNotFoundError)) or permanent_os_error(e)


def os_error_line(e: OSError) -> str:
    """One line for a permanent I/O error, naming the path and the fix."""
    where = e.filename or "an output"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left on the device holding {where} ({e.strerror}); what was committed before is intact: "
                "free some space, then run the same command again")
    if e.errno == errno.EROFS:
        return f"{where} is on a read-only file system: give a run_dir on a writable disk"
    return f"no permission to write {where} ({e.strerror}): give a run_dir you can write, or fix its permissions"


def user_line(e: BaseException) -> str:
    """The one line of a user's error."""
    return os_error_line(e) if permanent_os_error(e) else str(e)
