"""tests/progress.py, the wait of the subprocess tests and of run_ranks: a child that hangs (no CPU time in its
whole process tree) fails the wait, a slow one does not, however long it takes."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from tests import progress
from tests.parallel.launch import run_ranks

BUSY = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\nprint('done')"


def test_a_hung_child_fails_the_wait_and_is_killed():
    with pytest.raises(TimeoutError, match=r"used no CPU time for 2 s and did not exit: a hang"):
        progress.run(["bash", "-c", "sleep 600 & wait"], idle_s=2)


def test_a_child_working_past_the_idle_window_is_waited_for():
    done = progress.run([sys.executable, "-c", BUSY.format(s=5)], idle_s=2)
    assert (done.returncode, done.stdout) == (0, "done\n")


def test_the_work_of_a_grandchild_counts():
    """The direct child only waits (as a launcher does for its torchrun ranks); its child works."""
    done = progress.run(["bash", "-c", f"{sys.executable} -c \"{BUSY.format(s=5)}\"; exit 4"], idle_s=2)
    assert (done.returncode, done.stdout) == (4, "done\n")


def test_an_exit_code_and_both_streams_come_back():
    done = progress.run(["bash", "-c", "echo out; echo err >&2; exit 3"])
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def sleep_on_rank_1(rank: int, world: int) -> dict[str, torch.Tensor]:
    if rank == 1:
        time.sleep(600)
    return {}


def test_run_ranks_fails_a_hung_rank():
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 used no CPU time for 3 s"):
        run_ranks(2, sleep_on_rank_1, timeout=3)
