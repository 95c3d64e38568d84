"""run_ranks (tests/parallel/launch.py): a rank killed by a signal is run again once, all ranks afresh; a second
kill, or a rank that exits with a code, fails at once naming the ranks and their exit codes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.parallel.launch import RankKilled, run_ranks


def abort_first_time(rank: int, world: int, marker: str) -> dict[str, torch.Tensor]:
    if rank == 1 and not Path(marker).exists():
        Path(marker).touch()
        os.abort()
    return {"rank": torch.tensor(rank)}


def always_abort(rank: int, world: int) -> dict[str, torch.Tensor]:
    if rank == 0:
        os.abort()
    return {}


def exit_with_code(rank: int, world: int) -> dict[str, torch.Tensor]:
    if rank == 1:
        os._exit(3)
    return {}


def test_a_rank_killed_once_is_run_again(tmp_path):
    marker = tmp_path / "aborted"
    with pytest.warns(UserWarning, match=r"ranks \[1\] of 2 exited without a result .*-6.*once more"):
        out = run_ranks(2, abort_first_time, str(marker), timeout=60)
    assert marker.exists() and [int(r["rank"]) for r in out] == [0, 1]


def test_a_rank_killed_twice_fails():
    with pytest.warns(UserWarning), pytest.raises(RankKilled, match=r"ranks \[0\] of 2 .*\{0: -6\}"):
        run_ranks(2, always_abort, timeout=60)


def test_a_rank_exiting_with_a_code_fails_without_a_rerun():
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of 2 exited without a result .*\{1: 3\}") as e:
        run_ranks(2, exit_with_code, timeout=60)
    assert not isinstance(e.value, RankKilled)
