"""Test hooks for the multi-rank pipeline tests, loaded by every Python process (the torchrun launcher, every
rank) whose PYTHONPATH starts with this directory. Nothing in the library knows about them.

LONGSTRAW_TEST_COUNTS=<dir>: each rank appends one line per worker start ("start") and per model it loads or
builds ("load") to <dir>/rank<RANK>.txt.
LONGSTRAW_TEST_FAULT=<op>:<step>:<rank>[:<ERRNO>]: that rank raises in that op of that step (a RuntimeError, or
with an errno name such as ENOSPC the OSError a full disk raises, naming a file under the run dir).
LONGSTRAW_TEST_STALL=<op>:<step>:<rank>:<file>: in that op of that step, that rank writes its PID and its
launcher's process group (torchrun's, which runs each rank in a session of its own) to <file> and sleeps.
LONGSTRAW_TEST_PAUSE=<op>:<step>:<file>:<seconds>: rank 0, once that op of that step has run on every rank, writes
the same to <file> and sleeps that long before its next command (the other ranks wait for it meanwhile).
"""

import functools
import importlib.abc
import importlib.util
import os
import sys
import time

WATCHED = ("longstraw.train.worker", "longstraw.train.checkpoint", "longstraw.train.spmd")


def _note(what: str) -> None:
    d = os.environ["LONGSTRAW_TEST_COUNTS"]
    with open(os.path.join(d, f"rank{os.environ.get('RANK', '0')}.txt"), "a") as f:
        f.write(what + "\n")


def _counting(fn):
    @functools.wraps(fn)
    def wrapped(*a, **kw):
        _note("load")
        return fn(*a, **kw)
    return wrapped


def _patch(module) -> None:
    if os.environ.get("LONGSTRAW_TEST_COUNTS"):
        for name in ("load_model", "build_model"):
            if hasattr(module, name):
                setattr(module, name, _counting(getattr(module, name)))
        if module.__name__ == "longstraw.train.worker":
            start = module.Worker.OPS["start"]  # ops run from this table (spmd.execute)

            @functools.wraps(start)
            def counted_start(self, *a, **kw):
                _note("start")
                return start(self, *a, **kw)

            module.Worker.OPS["start"] = counted_start
    fault = os.environ.get("LONGSTRAW_TEST_FAULT")
    if fault and module.__name__ == "longstraw.train.worker":
        op, step, rank, *code = fault.split(":")

        def fail(self, *a, **kw):
            if code:
                import errno
                number = getattr(errno, code[0])
                raise OSError(number, os.strerror(number), os.path.join(self.cfg.run_dir, "checkpoints", "injected"))
            raise RuntimeError(f"injected {op} fault on rank {rank}")

        _instead(module, op, int(step), rank, fail)
    stall = os.environ.get("LONGSTRAW_TEST_STALL")
    if stall and module.__name__ == "longstraw.train.worker":
        op, step, rank, marker = stall.split(":", 3)

        def sleep(self, *a, **kw):
            _mark(marker)
            time.sleep(600)

        _instead(module, op, int(step), rank, sleep)
    pause = os.environ.get("LONGSTRAW_TEST_PAUSE")
    if pause and module.__name__ == "longstraw.train.spmd":
        op, step, marker, seconds = pause.split(":")
        call = module.Driver.call

        @functools.wraps(call)
        def paused(self, name, **params):
            out = call(self, name, **params)
            if name == op and params.get("step") == int(step):
                _mark(marker)
                time.sleep(float(seconds))
            return out

        module.Driver.call = paused


def _mark(marker: str) -> None:
    """This process's PID and its launcher's process group into `marker`, whole or not at all."""
    with open(marker + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {os.getpgid(os.getppid())}")
    os.replace(marker + ".tmp", marker)


def _instead(module, op: str, step: int, rank: str, fn) -> None:
    """Run `fn` instead of the worker's op `op` at that step on that rank."""
    original = module.Worker.OPS[op]

    @functools.wraps(original)
    def patched(self, *a, **kw):
        if kw.get("step") == step and os.environ.get("RANK") == rank:
            return fn(self, *a, **kw)
        return original(self, *a, **kw)

    module.Worker.OPS[op] = patched


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in WATCHED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if any(os.environ.get(f"LONGSTRAW_TEST_{what}") for what in ("COUNTS", "FAULT", "STALL", "PAUSE")):
    sys.meta_path.insert(0, _Finder())
