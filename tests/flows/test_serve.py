"""`longstraw serve` against a Prefect server started here on 127.0.0.1: the deployment gets the config's cron
schedule, and a run created through the API (what the UI's "Run" button does) completes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from uuid import UUID

import yaml

from flows.ui import free_port, start_prefect_server, stop_process
from tests.flows.test_train_flow import config

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.objects import State
    from prefect.client.schemas.responses import DeploymentResponse

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_for(what: str, fn: Callable[[], T | None], timeout: float, log: Path) -> T:
    """fn()'s first value that is not None, polled each second; else fail quoting the tail of `log`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = fn()
        if value is not None:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}; log:\n{log.read_text()[-4000:]}")


@contextmanager
def serving(cfg_path: Path, api: str, home: Path, log: Path) -> Iterator[subprocess.Popen]:
    """`longstraw serve --config cfg_path` against the Prefect API `api`; stopped (its process group) on exit."""
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(home), "PYTHONPATH": str(ROOT)}
    serve = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(cfg_path)], cwd=ROOT,
                             env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield serve
    finally:
        stop_process(serve, timeout=30)


def registered(client: SyncPrefectClient, name: str, serve: subprocess.Popen, log: Path,
               timeout: float = 180) -> DeploymentResponse:
    """The deployment `name` once `serve` has registered it."""
    def deployment():
        try:
            return client.read_deployment_by_name(name)
        except Exception:
            assert serve.poll() is None, f"serve exited early:\n{log.read_text()[-4000:]}"
            return None

    return wait_for("the deployment", deployment, timeout, log)


def final_state(client: SyncPrefectClient, flow_run_id: UUID, log: Path, timeout: float = 300) -> State:
    """The state of flow run `flow_run_id` once it is final."""
    def finished():
        state = client.read_flow_run(flow_run_id).state
        return state if state is not None and state.is_final() else None

    return wait_for(f"flow run {flow_run_id}", finished, timeout, log)


def test_serve_registers_nightly_schedule_and_runs_a_triggered_flow(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path / "prefect-home"
    api, server = start_prefect_server(free_port(), home, logs=tmp_path / "logs", timeout=180)
    cfg = config(tmp_path / "run", steps=1)
    cfg["schedule"] = {"deployment": "nightly", "cron": "30 3 * * 1", "timezone": "Europe/Berlin"}
    cfg_path = tmp_path / "train.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "serve.log"
    try:
        # this process talks to the same server (settings are read at import, so not via os.environ)
        with serving(cfg_path, api, home, log) as serve, temporary_settings({PREFECT_API_URL: api}), \
                get_client(sync_client=True) as client:
            dep = registered(client, "grpo-train/nightly", serve, log)
            (sched,) = dep.schedules
            assert sched.active
            assert sched.schedule.cron == "30 3 * * 1" and sched.schedule.timezone == "Europe/Berlin"
            assert dep.parameters["config"]["run_dir"] == str(tmp_path / "run")

            run = client.create_flow_run_from_deployment(dep.id)
            state = final_state(client, run.id, log)
            assert state.is_completed(), f"{state}\n{log.read_text()[-4000:]}"
        assert (tmp_path / "run" / "checkpoints" / "update-000001" / "trainer.json").is_file()
    finally:
        stop_process(server)
