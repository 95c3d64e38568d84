"""The command line turns expected failures into one clear line and exit status 2, not a traceback."""

from __future__ import annotations

import errno
import os

import pytest

import longstraw.cli as cli


@pytest.mark.parametrize("code, words", [
    (errno.ENOSPC, "no space left on the device holding"),
    (errno.EROFS, "is on a read-only file system"),
    (errno.EACCES, "no permission to write"),
])
def test_a_full_or_read_only_disk_is_one_clear_line(monkeypatch, capsys, tmp_path, code, words):
    def fail(_args):
        raise OSError(code, os.strerror(code), str(tmp_path / "ckpt"))

    monkeypatch.setattr(cli, "_state_size", fail)
    assert cli.main(["state-size", "--config", "x", "--tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "ckpt" in err
    assert "resume" not in err  # a resume would fail the same way until the disk is fixed


def test_a_transient_io_error_is_not_dressed_up_as_the_users(monkeypatch):
    def other(_args):
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    monkeypatch.setattr(cli, "_state_size", other)
    with pytest.raises(ConnectionResetError):
        cli.main(["state-size", "--config", "x", "--tokens", "8"])


def test_the_library_cli_imports_neither_the_pipeline_nor_the_tools():
    """`longstraw.cli` is the library's entry point: importing it loads no `longstraw.train` (the pipeline) and
    no `longstraw.tools` module; each command imports what it runs."""
    import subprocess
    import sys

    code = ("import sys, longstraw.cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('longstraw.train', 'longstraw.tools'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_yaml_reads_an_exponent_without_a_dot_as_a_float(tmp_path):
    """`rms_norm_eps: 1e-6` (as JSON and YAML 1.2 read it) is a float, not YAML 1.1's string '1e-6'; integers and
    quoted strings stay as they are."""
    from longstraw.config import read_yaml

    path = tmp_path / "c.yaml"
    path.write_text("eps: 1e-06\nbig: 1E5\nneg: -2e+3\nn: 42\nq: '1e-6'\nword: abc1e5\n")
    data = read_yaml(path)
    assert data == {"eps": 1e-6, "big": 1e5, "neg": -2e3, "n": 42, "q": "1e-6", "word": "abc1e5"}
    assert isinstance(data["n"], int) and isinstance(data["eps"], float)
