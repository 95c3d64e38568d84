"""`longstraw serve` against a Prefect server started here on 127.0.0.1: the deployment gets the config's cron
schedule, and a run created through the API (what the UI's "Run" button does) completes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from flows.ui import free_port, start_prefect_server, stop_process
from tests.flows.test_train_flow import config

ROOT = Path(__file__).resolve().parents[2]


def wait_for(what: str, fn, timeout: float, log: Path):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = fn()
        if value is not None:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}; serve log:\n{log.read_text()[-4000:]}")


def test_serve_registers_nightly_schedule_and_runs_a_triggered_flow(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path / "prefect-home"
    api, server = start_prefect_server(free_port(), home, logs=tmp_path / "logs", timeout=180)
    cfg = config(tmp_path / "run", steps=1)
    cfg["schedule"] = {"deployment": "nightly", "cron": "30 3 * * 1", "timezone": "Europe/Berlin"}
    cfg_path = tmp_path / "train.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(home), "PYTHONPATH": str(ROOT)}
    log = tmp_path / "serve.log"
    serve = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(cfg_path)], cwd=ROOT,
                             env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # this process talks to the same server (settings are read at import, so not via os.environ)
        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            def deployment():
                try:
                    return client.read_deployment_by_name("grpo-train/nightly")
                except Exception:
                    assert serve.poll() is None, f"serve exited early:\n{log.read_text()[-4000:]}"
                    return None

            dep = wait_for("the deployment", deployment, 180, log)
            (sched,) = dep.schedules
            assert sched.active
            assert sched.schedule.cron == "30 3 * * 1" and sched.schedule.timezone == "Europe/Berlin"
            assert dep.parameters["config"]["run_dir"] == str(tmp_path / "run")

            run = client.create_flow_run_from_deployment(dep.id)

            def finished():
                state = client.read_flow_run(run.id).state
                return state if state is not None and state.is_final() else None

            state = wait_for("the triggered run", finished, 300, log)
            assert state.is_completed(), f"{state}\n{log.read_text()[-4000:]}"
        assert (tmp_path / "run" / "checkpoints" / "update-000001" / "trainer.json").is_file()
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGTERM)
            try:
                serve.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
        stop_process(server)
