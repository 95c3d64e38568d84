"""The command line turns expected failures into one clear line and exit status 2, not a traceback."""

from __future__ import annotations

import errno

import pytest

import longstraw.cli as cli


def test_a_full_disk_is_one_clear_line(monkeypatch, capsys, tmp_path):
    def full(_args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt"))

    monkeypatch.setattr(cli, "_state_size", full)
    assert cli.main(["state-size", "--config", "x", "--tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "no space left on the device holding" in err and "ckpt" in err and "longstraw resume" in err

    def other(_args):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(cli, "_state_size", other)
    with pytest.raises(PermissionError):  # not a disk-full: not dressed up as one
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
