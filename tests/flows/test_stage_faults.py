"""I/O faults in stages, a moved run directory and NaN rewards, on one process (`flows.cli.main`, what a user
types): a full or read-only disk is one line and exit 2, never a retry of a stage whose effect lives in the ranks'
memory (a retry there stepped twice and failed with a lineage error); a transient error in a cached stage is still
retried; a copied or moved run directory keeps its cache; a reward that is mostly NaN stops the run."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil

import pytest
import torch
import yaml

import longstraw.train.checkpoint as ckpt
from flows.cli import main
from longstraw.train import inputs
from tasks.run import Run, config_digest, portable, rooted
from tasks.stages import transient
from tests.flows.test_train_flow import config, counted, weights  # noqa: F401 - counted: a fixture

FAST_RETRIES = {"branches_per_task": 1, "retries": 2, "retry_delay_seconds": 0}


def _config_file(tmp_path, run_dir, **kw) -> str:
    path = tmp_path / f"{os.path.basename(run_dir)}.yaml"
    path.write_text(yaml.safe_dump(config(run_dir, **kw)))
    return str(path)


def _last_line(capsys) -> tuple[str, str]:
    err = capsys.readouterr().err
    return err, err.strip().splitlines()[-1]


def test_which_errors_are_retried():
    assert transient(ConnectionResetError(errno.ECONNRESET, "reset")) and transient(TimeoutError())
    assert transient(OSError(errno.EIO, "Input/output error"))
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
        assert not transient(OSError(code, os.strerror(code)))
    assert not transient(FileNotFoundError(errno.ENOENT, "gone")) and not transient(RuntimeError("x"))


def test_paths_in_keys_and_results_are_relative_to_the_run_dir(tmp_path):
    a, b = config(tmp_path / "a"), config(tmp_path / "elsewhere" / "b")
    from longstraw.train.config import TrainConfig

    assert config_digest(TrainConfig.model_validate(a)) == config_digest(TrainConfig.model_validate(b))
    out = {"url": f"{tmp_path}/a/store/states/step-000000", "sha256": "x", "n": 1.5,
           "list": [f"{tmp_path}/a/x"], "other": f"{tmp_path}/ab/y"}
    moved = rooted(portable(out, str(tmp_path / "a")), str(tmp_path / "b"))
    assert moved == {**out, "url": f"{tmp_path}/b/store/states/step-000000", "list": [f"{tmp_path}/b/x"]}
    assert Run.resolve(TrainConfig.model_validate(a)).digest == config_digest(TrainConfig.model_validate(a))


def test_a_full_disk_then_space_back_then_a_moved_copy(tmp_path, counted, monkeypatch, capsys):
    """ENOSPC writing step 1's checkpoint: one line, exit 2, the optimizer ran once (a retry stepped twice and
    then failed with a lineage error). With space back the same command finishes the step from what was stored (a
    resume ends as an uninterrupted run: test_train_flow); a copy of the failed run, its original moved away,
    resumes without recomputing what it stored, to the same weights."""
    run = tmp_path / "run"
    command = ["train", "--config", _config_file(tmp_path, run, pipeline=FAST_RETRIES), "--no-progress"]
    write = ckpt.write_state_dict

    def full(state, model_config, where, *a, **kw):
        if "update-000002" in str(where):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))
        return write(state, model_config, where, *a, **kw)

    monkeypatch.setattr(ckpt, "write_state_dict", full)
    assert main(command) == 2
    err, last = _last_line(capsys)
    assert "no space left on the device holding" in last and "free some space" in last
    assert last.startswith("longstraw train: error:") and "ranks hold weights" not in err
    assert counted[("optimizer", 1)] == 1  # never retried
    assert not list((run / "checkpoints").glob("*update-000002*"))  # nothing half-written left
    monkeypatch.setattr(ckpt, "write_state_dict", write)
    shutil.copytree(run, tmp_path / "copy")

    before = counted.copy()
    assert main(command) == 0  # space back: the same command
    new = counted - before
    assert new[("capture", 1)] == new[("rollout", 1)] == new[("reward", 1)] == 0 and new[("optimizer", 1)] == 1
    want = weights({"checkpoint": str(run / "checkpoints" / "update-000002")})

    run.rename(tmp_path / "moved-away")  # the copy's stored results named files here: now gone
    before = counted.copy()
    assert main(["resume", str(tmp_path / "copy"), "--no-progress"]) == 0
    new = counted - before
    assert new[("capture", 1)] == new[("rollout", 1)] == new[("reward", 1)] == 0  # stored, not recomputed
    assert new[("replay", 1)] == 4 and new[("optimizer", 1)] == 1
    assert not run.exists()  # nothing written where the original was (its MLflow artefacts: beside the copy's db)
    assert (tmp_path / "copy" / "mlartifacts").is_dir()
    got = weights({"checkpoint": str(tmp_path / "copy" / "checkpoints" / "update-000002")})
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_read_only_run_dir_is_one_line(tmp_path, counted, monkeypatch, capsys):
    """EROFS writing the reward's record (a cached stage, which retries transient errors): one line, exit 2, and
    the stage ran once."""
    save = inputs.save_json

    def read_only(path, data):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(inputs, "save_json", read_only)
    cmd = ["train", "--config", _config_file(tmp_path, tmp_path / "run", steps=1, pipeline=FAST_RETRIES),
           "--no-progress"]
    assert main(cmd) == 2
    _, last = _last_line(capsys)
    assert "is on a read-only file system" in last and "rewards-g000.json" in last and "resume" not in last
    assert counted[("reward", 0)] == 1
    monkeypatch.setattr(inputs, "save_json", save)


NAN_EVERY = [0, 4]  # calls so far, and every how many-th answer scores NaN


def sometimes_nan(prompt_meta: dict, response_text: str) -> float:
    NAN_EVERY[0] += 1
    return math.nan if NAN_EVERY[0] % NAN_EVERY[1] == 0 else float(len(response_text) % 3)


def test_a_transient_error_is_retried_and_few_nans_warn_once(tmp_path, counted, monkeypatch, caplog):
    """A dropped connection in the reward stage: retried, the run finishes. One answer of four scores NaN: one
    warning for the group, not one per answer."""
    reward = inputs.reward_stage
    failures = [ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")]
    calls = []

    def flaky(*a, **kw):
        calls.append(kw["step"])
        if failures:
            raise failures.pop()
        return reward(*a, **kw)

    monkeypatch.setattr(inputs, "reward_stage", flaky)
    NAN_EVERY[:] = [0, 4]
    cmd = ["train", "--config", _config_file(tmp_path, tmp_path / "run", steps=1, pipeline=FAST_RETRIES,
                                             reward="tests.flows.test_stage_faults:sometimes_nan"), "--no-progress"]
    with caplog.at_level(logging.WARNING):
        assert main(cmd) == 0
    assert calls == [0, 0]  # the failed call, then its retry
    nan_lines = [r.getMessage() for r in caplog.records if "NaN" in r.getMessage() or "nan" in r.getMessage()]
    assert nan_lines == ["reward tests.flows.test_stage_faults:sometimes_nan: 1 of 4 samples NaN in step 0 group 0, "
                         "each scored 0.0 and counted "
                         "in reward_failures"]
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert history[0]["reward_failures"] == 1


def always_nan(prompt_meta: dict, response_text: str) -> float:
    return math.nan


def test_a_reward_that_is_mostly_nan_stops_the_run(tmp_path, counted, capsys):
    cmd = ["train", "--config", _config_file(tmp_path, tmp_path / "run", steps=1, pipeline=FAST_RETRIES,
                                             reward="tests.flows.test_stage_faults:always_nan"), "--no-progress"]
    assert main(cmd) == 2
    _, last = _last_line(capsys)
    assert "reward tests.flows.test_stage_faults:always_nan returned NaN for 4 of 4 answers (100%)" in last
    assert "reward_nan_max_share 0.5" in last
    assert counted[("reward", 0)] == 1 and counted[("replay", 0)] == 0
