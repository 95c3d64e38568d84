"""One run per run directory: a second `longstraw train` on a held directory exits non-zero, names the holder
and writes nothing; the lock dies with its holder (kill -9), so a resume is never blocked by a stale one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import yaml

from flows.cli import main
from longstraw.train.lock import RunDirLocked, RunLock
from tests.flows.test_train_flow import config

HOLD = "import sys, time; from longstraw.train.lock import RunLock; lock = RunLock(sys.argv[1]).__enter__(); print('held', flush=True); time.sleep(120)"


def _holder(run_dir) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_train_on_a_held_run_dir_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config(run_dir, steps=1)))
    holder = _holder(run_dir)
    try:
        assert main(["train", "--config", str(path), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by PID {holder.pid} on host" in err and "another --run-dir" in err
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # no config.json, no checkpoint
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
    with RunLock(run_dir):  # the kernel dropped the dead holder's lock
        with pytest.raises(RunDirLocked, match=f"in use by PID {os.getpid()}"):
            RunLock(run_dir).__enter__()


def test_resume_of_a_moved_run_dir_uses_the_given_directory(tmp_path):
    """`longstraw resume <dir>` continues in <dir>, not in the run_dir its config.json recorded before a move."""
    import json

    from flows.cli import _resume_config

    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "config.json").write_text(json.dumps(config(tmp_path / "old-place")))
    assert _resume_config(str(moved))["run_dir"] == str(moved.resolve())


def test_bad_reward_fails_before_anything_is_written(tmp_path, capsys):
    run_dir = tmp_path / "run"
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config(run_dir, steps=1, reward="math:pi")))
    assert main(["train", "--config", str(path), "--no-progress"]) == 2
    assert "reward 'math:pi' is a float, not a function" in capsys.readouterr().err
    assert not run_dir.exists()  # checked before the lock (longstraw/train/preflight.py)
