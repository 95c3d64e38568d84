"""What a user sees when a rank of `longstraw train --nproc 2` fails, and that nothing of the job is left running.

- kill -9 of rank 1, then of rank 0, mid-run: the job ends within seconds (torchrun alone would wait its 30 s
  grace for the surviving rank), advises a resume, and no process of the job is left: ranks, torchrun's agent,
  the temporary Prefect server that rank 0's flow started (re-parented to the agent when rank 0 is killed);
- a user's error on the ranks (the checkpoint they load is corrupted): exit 2, the last line names it, no resume;
- a full disk on rank 1, a reward that is all NaN on rank 0: exit 2, the last line names it, no resume.
One run directory for the first three (each test continues it), 1 step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.flows.test_ranks import ROOT, _env
from tests.flows.test_train_flow import config
from tests.progress import IdleWatch, descendants, kill_tree

EXIT_AFTER_KILL_S = 20.0  # well under torchrun's 30 s grace, which the ranks used to wait out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The run's YAML; its run dir is beside it."""
    d = tmp_path_factory.mktemp("faults")
    path = d / "run.yaml"
    path.write_text(yaml.safe_dump(config(d / "run", steps=1, threads=1)))
    return path


def _cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def _job_left(job: dict[int, str | None], tmp: Path) -> list[str]:
    """Processes of the job still running: those seen in its tree mid-run (same pid and command line), and any
    whose command line names the test's directory (a rank's --config-json names the run dir)."""
    left = [f"{pid}: {cmd}" for pid, cmd in job.items() if cmd is not None and _cmdline(pid) == cmd]
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid() and int(entry.name) not in job:
            cmd = _cmdline(int(entry.name))
            if cmd and str(tmp) in cmd and "pytest" not in cmd:
                left.append(f"{entry.name}: {cmd}")
    return left


def _kill_rank_mid_run(args: list[str], rank: int, tmp: Path) -> tuple[subprocess.CompletedProcess, float]:
    """Run `longstraw ARGS --nproc 2` until `rank` stalls in step 0's replay, kill -9 it; the finished command and
    the seconds from the kill to the command's end. Asserts that no process of the job is left."""
    marker = tmp / f"stall-{rank}"
    marker.unlink(missing_ok=True)
    env = _env(LONGSTRAW_TEST_STALL=f"replay:0:{rank}:{marker}")
    env.pop("PREFECT_API_URL", None)  # not the session's server (tests/flows/conftest.py): the job starts its own
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args, "--nproc", "2", "--no-progress"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        watch = IdleWatch()
        while not marker.exists():  # a hang fails, a slow machine does not
            assert proc.poll() is None, proc.communicate()
            assert not watch.idle([proc.pid]), "the run hung before rank's stall"
            time.sleep(0.2)
        job = {pid: _cmdline(pid) for pid in descendants(proc.pid)}
        assert any("uvicorn" in (cmd or "") for cmd in job.values()), job  # the server whose fate is checked
        os.kill(int(marker.read_text().split()[0]), signal.SIGKILL)
        killed = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)  # the bound that matters is asserted below
        took = time.monotonic() - killed
    finally:
        kill_tree(proc)
        proc.wait()
    print(f"the job ended {took:.1f} s after the kill of rank {rank}")
    time.sleep(0.5)  # /proc entries of processes just reaped
    assert not _job_left(job, tmp), _job_left(job, tmp)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), took


def _last_line(done: subprocess.CompletedProcess) -> str:
    return done.stderr.strip().splitlines()[-1]


def test_kill_9_of_rank_1_ends_the_job_in_seconds_and_leaves_nothing(run):
    done, took = _kill_rank_mid_run(["train", "--config", str(run)], 1, run.parent)
    assert done.returncode == 1, done.stderr[-3000:]
    assert took < EXIT_AFTER_KILL_S, (took, done.stderr[-3000:])
    assert "rank 0: stopped by SIGTERM" in done.stderr, done.stderr[-3000:]
    assert "torchrun: rank 1 (pid" in done.stderr and "with signal 9" in done.stderr, done.stderr[-3000:]
    assert _last_line(done).endswith(f"`longstraw resume {run.parent / 'run'}` continues it"), _last_line(done)


def test_kill_9_of_rank_0_ends_the_job_in_seconds_and_stops_its_prefect_server(run):
    """Rank 0 runs no exit handler: its temporary Prefect server is re-parented to torchrun's agent, which stops
    it (checked in `_kill_rank_mid_run`)."""
    done, took = _kill_rank_mid_run(["resume", str(run.parent / "run")], 0, run.parent)
    assert done.returncode == 1, done.stderr[-3000:]
    assert took < EXIT_AFTER_KILL_S, (took, done.stderr[-3000:])
    assert "torchrun: rank 0 (pid" in done.stderr and "with signal 9" in done.stderr, done.stderr[-3000:]
    assert _last_line(done).endswith(f"`longstraw resume {run.parent / 'run'}` continues it"), _last_line(done)


def test_a_corrupted_checkpoint_on_two_ranks_is_a_users_error(run):
    """The ranks find the checkpoint they load corrupted: a resume would fail the same way, so the last line names
    the corruption, without a resume's advice, and the exit status is 2, as on one rank."""
    run_dir = run.parent / "run"
    weights = run_dir / "checkpoints" / "update-000000" / "model.safetensors"  # committed before the kills
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0xFF
    weights.write_bytes(bytes(data))
    from tests import progress

    done = progress.run([sys.executable, "-m", "flows.cli", "resume", str(run_dir), "--nproc", "2", "--no-progress"],
                        cwd=ROOT, env=_env())
    assert done.returncode == 2, done.stderr[-3000:]
    last = _last_line(done)
    assert "model.safetensors does not match its sha256 (corrupted)" in last, last
    assert "longstraw resume" not in last and "LeaderLost" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("case", ["disk full on rank 1", "NaN reward on rank 0"])
def test_a_full_disk_or_a_nan_reward_on_two_ranks_is_a_users_error(tmp_path, case):
    """Whichever rank meets it, the user's error is the last line on N ranks as on one (tests/test_cli.py,
    tests/flows/test_stage_faults.py), with exit 2 and no resume's advice, which would fail the same way."""
    from tests import progress

    nan = case.startswith("NaN")
    cfg = config(tmp_path / "run", steps=1, threads=1,
                 **({"reward": "tests.flows.test_stage_faults:always_nan"} if nan else {}))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = _env() if nan else _env(LONGSTRAW_TEST_FAULT="optimizer:0:1:ENOSPC")
    done = progress.run([sys.executable, "-m", "flows.cli", "train", "--config", str(path), "--nproc", "2",
                         "--no-progress"], cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    last = _last_line(done)
    words = ("returned NaN for" if nan else f"no space left on the device holding {tmp_path / 'run'}")
    assert words in last and "resume" not in last, done.stderr[-3000:]
