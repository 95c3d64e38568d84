"""The one way LongStraw writes what it stores, and the one checksum it verifies it with.

Writes are atomic (`atomic_output`): into a temporary sibling, fsynced, then renamed into place, so a reader
sees the old file or directory or the whole new one, never a part; on failure the temporary is removed. The
checksum is the sha256 of a file's bytes; a multi-file artefact (a checkpoint directory, a zarr store) lists
one per file, and its content hash is `digest` of that list.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem


@dataclass(frozen=True)
class Artefact:
    """A stored artefact one stage hands to the next: where it is (a local path or an fsspec URL) and the sha256
    that pins its bytes (a file's, or the manifest's of a zarr group). Crosses tasks and ranks as the JSON
    {"path", "sha256"}; a stage's result that names one holds those two keys among its metrics."""

    path: str
    sha256: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "sha256": self.sha256}

    @classmethod
    def from_json(cls, record: Mapping) -> Artefact:
        return cls(str(record["path"]), str(record["sha256"]))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_checksums(directory: str | Path) -> dict[str, str]:
    """sha256 of every file below `directory`, by relative path, sorted."""
    d = Path(directory)
    return {str(f.relative_to(d)): sha256_file(f) for f in sorted(d.rglob("*")) if f.is_file()}


def digest(checksums: dict[str, str]) -> str:
    """Content hash of a multi-file artefact: sha256 of its sorted {file: sha256} list."""
    return sha256_bytes(json.dumps(checksums, sort_keys=True).encode())


class CorruptArtefact(ValueError):
    """A stored artefact that is not what was written (bytes or manifest changed). `where` names it (a path or
    URL), so that a pipeline can drop it and compute it again."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def verify_file(path: str | Path, sha256: str | None, what: str = "artefact") -> Path:
    """`path` if it exists and (when `sha256` is given) its bytes hash to it; else a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} is missing; re-run the stage that writes it")
    if sha256 is not None and sha256_file(path) != sha256:
        raise CorruptArtefact(f"{what} {path} does not match its recorded sha256 (corrupted or overwritten); "
                              f"delete it and re-run the stage that writes it", str(path))
    return path


def _fsync_tree(path: str) -> None:
    """Flush a written file, or every file of a directory and the directories themselves, to the disk."""
    paths = [path] if os.path.isfile(path) else [os.path.join(r, n) for r, _, fs in os.walk(path) for n in fs]
    dirs = [] if os.path.isfile(path) else [r for r, _, _ in os.walk(path)]
    for p in paths:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    for d in dirs:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def atomic_output(target: str | Path, *, fs: fsspec.AbstractFileSystem | None = None,
                  commit: Callable[[str], None] | None = None) -> Iterator[str]:
    """`with atomic_output(path) as tmp:` write a file or a directory at `tmp`; it appears at `path` whole, or
    not at all.

    On success the temporary is fsynced (local disks) and swapped in: a file replaces the old one in one rename; a
    directory moves an existing one aside, is moved into place, `commit(path)` runs (e.g. writing a commit marker
    that readers require), and the old one is deleted. If `commit` fails, the old directory is put back. `fs`: an
    fsspec filesystem for other storage (object stores move by copy-and-delete, so there only the commit marker
    makes a write visible). One writer per target at a time.
    """
    fs = fs or LocalFileSystem()
    local = isinstance(fs, LocalFileSystem)
    final = str(target).rstrip("/")
    tag = uuid.uuid4().hex[:12]
    parent, name = final.rsplit("/", 1) if "/" in final else (".", final)
    tmp = f"{parent}/.{name}.tmp-{tag}"
    if local:
        os.makedirs(parent, exist_ok=True)
    try:
        yield tmp
        if local:
            _fsync_tree(tmp)
        _swap_in(fs, tmp, final, tag, commit)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp, recursive=True)
        raise


def remove_stale_temporaries(directory: str | Path) -> list[str]:
    """Delete the temporaries (`.{name}.tmp-*`) that writers killed mid-write left in a local `directory`; only for
    a caller that holds it exclusively (the run-directory lock). Returns their names."""
    d = Path(directory)
    stale = sorted(d.glob(".*.tmp-*")) if d.is_dir() else []
    for p in stale:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return [p.name for p in stale]


def _move(fs, src: str, dst: str) -> None:
    if isinstance(fs, LocalFileSystem):
        os.replace(src, dst)  # atomic on one filesystem
    else:
        fs.mv(src, dst, recursive=True)


def _swap_in(fs, tmp: str, final: str, tag: str, commit: Callable[[str], None] | None) -> None:
    if fs.isfile(tmp):
        _move(fs, tmp, final)
        if commit is not None:
            commit(final)
        return
    old = f"{final}.old-{tag}"
    had_old = fs.exists(final)
    if had_old:
        _move(fs, final, old)
    try:
        _move(fs, tmp, final)
        if commit is not None:
            commit(final)
    except BaseException:
        if fs.exists(final):
            _move(fs, final, tmp)  # the caller removes it
        if had_old:
            _move(fs, old, final)
        raise
    if had_old:
        fs.rm(old, recursive=True)


def write_bytes(path: str | Path, data: bytes, fs: fsspec.AbstractFileSystem | None = None) -> str:
    """Write `data` to `path` atomically; returns its sha256."""
    fs = fs or LocalFileSystem()
    with atomic_output(path, fs=fs) as tmp:
        fs.pipe_file(tmp, data)
    return sha256_bytes(data)
