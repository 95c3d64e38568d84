"""kill -9 of the whole run (flow, stages, the embedded Prefect server) while the optimizer stage writes its
checkpoint: the last committed checkpoint is intact, and `longstraw resume` finishes the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import yaml

from flows.cli import main
from longstraw.files import sha256_file
from longstraw.train.checkpoint import latest_checkpoint, read_trainer
from tests.flows.test_train_flow import config

# Run `longstraw train`, but stall inside the checkpoint write of update 2 (step 1's) and say so in a file.
STALLING_TRAIN = """
import sys, time
from pathlib import Path
import longstraw.train.checkpoint as ck
real = ck.save_file
def stalling(tensors, path, **kw):  # the RNG file, written between the weights and the optimizer shards
    if "update-000002" in path:
        Path(sys.argv[2]).write_text("writing")
        time.sleep(300)
    return real(tensors, path, **kw)
ck.save_file = stalling
from flows.cli import main
sys.exit(main(["train", "--config", sys.argv[1], "--no-progress"]))
"""


def test_kill_9_during_the_checkpoint_write_then_resume(tmp_path):
    run_dir = tmp_path / "run"
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config(run_dir, steps=2)))
    marker = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", STALLING_TRAIN, str(path), str(marker)], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            # its own embedded server, killed with it (not the session's: tests/flows/conftest.py)
                            env={k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"})
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, "the run ended before its last checkpoint write"
            assert time.monotonic() < deadline, "the run never reached its last checkpoint write"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    checkpoints = run_dir / "checkpoints"
    committed = latest_checkpoint(checkpoints)
    assert committed.name == "update-000001"  # the half-written update 2 is not a checkpoint
    read_trainer(committed)  # every file matches its checksum
    before = {p.name: sha256_file(p) for p in committed.iterdir() if p.is_file()}
    assert main(["resume", str(run_dir), "--no-progress"]) == 0
    assert latest_checkpoint(checkpoints).name == "update-000002"
    read_trainer(checkpoints / "update-000002")
    assert {p.name: sha256_file(p) for p in committed.iterdir() if p.is_file()} == before
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("longstraw").experiment_id],
                              "tags.run_dir != ''")  # the parent runs
    assert sorted(r.info.status for r in runs) == ["FINISHED", "KILLED"]  # the killed one is not left RUNNING
    # the killed writer's temporary is gone too
    assert sorted(p.name for p in checkpoints.iterdir()) == ["update-000000", "update-000001", "update-000002"]
