"""`flows.ui.start_ui` starts a Prefect and an MLflow server on loopback, both healthy, and stops both."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

pytest.importorskip("prefect")
pytest.importorskip("mlflow")

from flows.ui import free_port, start_ui  # noqa: E402


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only: ignore any http_proxy


def _get(url: str):
    with _DIRECT.open(url, timeout=5) as r:
        assert r.status == 200, url
        return r.read()


def test_start_ui_serves_prefect_and_mlflow_on_loopback(tmp_path):
    t0 = time.monotonic()
    pport, mport = free_port(), free_port()
    ui = start_ui(prefect_port=pport, mlflow_port=mport, backend_store_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                  home=tmp_path / "prefect-home", logs=tmp_path / "logs", artifacts=tmp_path / "mlartifacts",
                  timeout=60)
    try:
        assert ui.prefect_api_url == f"http://127.0.0.1:{pport}/api"
        assert ui.mlflow_url == f"http://127.0.0.1:{mport}"
        assert json.loads(_get(f"{ui.prefect_api_url}/health")) is True
        assert json.loads(_get(f"{ui.prefect_url}/ui-settings"))["api_url"] == ui.prefect_api_url  # the UI's API
        assert _get(f"{ui.mlflow_url}/health").strip() == b"OK"
        found = json.loads(_get(f"{ui.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=10"))
        assert "Default" in [e["name"] for e in found["experiments"]]
        assert (tmp_path / "prefect-home").is_dir() and (tmp_path / "logs" / "prefect-server.log").is_file()
        assert ui.alive()
    finally:
        ui.stop(timeout=10)
    assert ui.prefect.poll() is not None and ui.mlflow.poll() is not None
    assert time.monotonic() - t0 < 60


def test_start_prefect_server_refuses_a_busy_port(tmp_path):
    import socket

    from flows.ui import ServerStartError, start_prefect_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ServerStartError, match="already in use"):
            start_prefect_server(s.getsockname()[1], tmp_path / "home", logs=tmp_path / "logs")
