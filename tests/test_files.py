"""`files.atomic_output`: a file or directory appears whole or not at all; a failed commit puts the old one back."""

from __future__ import annotations

import pytest

from longstraw.files import atomic_output, digest, file_checksums, sha256_file, verify_file, write_bytes


def test_file_replaced_whole_and_a_failed_write_leaves_the_old_one(tmp_path):
    path = tmp_path / "a.json"
    assert write_bytes(path, b"one") == sha256_file(path)
    with pytest.raises(OSError, match="disk full"):
        with atomic_output(path) as tmp:
            open(tmp, "wb").write(b"two, half writ")
            raise OSError("disk full")
    assert path.read_bytes() == b"one" and [p.name for p in tmp_path.iterdir()] == ["a.json"]
    write_bytes(path, b"three")
    assert path.read_bytes() == b"three" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_directory_swap_and_failed_commit(tmp_path):
    target = tmp_path / "ckpt"

    def make(tmp: str, text: str) -> None:
        (tmp_path / tmp).mkdir()
        (tmp_path / tmp / "w.bin").write_text(text)

    with atomic_output(target) as tmp:
        make(tmp, "old")
    sums = file_checksums(target)

    def failing_commit(root: str) -> None:
        assert (tmp_path / "ckpt" / "w.bin").read_text() == "new"  # in place, whole, before the commit
        raise KeyboardInterrupt("killed while committing")

    with pytest.raises(KeyboardInterrupt):
        with atomic_output(target, commit=failing_commit) as tmp:
            make(tmp, "new")
    assert (target / "w.bin").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    with atomic_output(target) as tmp:
        make(tmp, "new")
    assert (target / "w.bin").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert digest(file_checksums(target)) != digest(sums)


def test_verify_names_the_problem(tmp_path):
    path = tmp_path / "g.safetensors"
    sha = write_bytes(path, b"gradients")
    assert verify_file(path, sha) == path
    path.write_bytes(b"gradientz")
    with pytest.raises(ValueError, match="does not match its recorded sha256"):
        verify_file(path, sha)
    with pytest.raises(FileNotFoundError, match="missing"):
        verify_file(tmp_path / "nope", sha)
