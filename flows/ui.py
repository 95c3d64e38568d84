"""`longstraw ui`: a Prefect and an MLflow server for one machine, run through their own CLIs from this environment,
bound to 127.0.0.1 unless a host is passed on purpose (neither has authentication here). POSIX only.
For a long-lived setup (systemd units, a worker on a work pool) see infra/README.md."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"
DEFAULT_LOGS = Path("runs") / "ui-logs"
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # health checks ignore any http_proxy
# defaults the user's environment may override; MLflow's job runner (GenAI jobs, seven huey consumers) is unused here
_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


class ServerStartError(RuntimeError):
    """A server exited or did not answer its health check in time; the message holds the tail of its log."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` right now (another process may take it later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM a server's process group, SIGKILL what is left after `timeout` s (children can outlive the leader)."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
        except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
            pass


def _client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host` (a wildcard bind is reached on loopback)."""
    return LOOPBACK if host in ("", "0.0.0.0", "::") else host


def _spawn(name: str, cmd: list[str], env: dict[str, str], host: str, port: int, path: str,
           logs: str | os.PathLike) -> tuple[str, subprocess.Popen, Path]:
    """Start server `cmd` on host:port; returns (URL of `path`, process, its log file)."""
    client = _client_host(host)
    with socket.socket() as s:
        s.settimeout(0.5)
        if s.connect_ex((client, port)) == 0:
            raise ServerStartError(f"port {port} on {host} is already in use; pick another {name} port")
    url, log = f"http://{client}:{port}{path}", Path(logs).resolve() / f"{name.lower()}-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:  # own process group, so that stop_process reaches the server's workers too
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return url, proc, log


def _wait(name: str, url: str, proc: subprocess.Popen, log: Path, timeout: float) -> tuple[str, subprocess.Popen]:
    """(url, proc) once GET `url`/health answers; else stop the server and raise ServerStartError."""
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                _DIRECT.open(f"{url}/health", timeout=2).close()  # anything but 2xx raises
                return url, proc
            except OSError:  # refused, reset, HTTP error: not up yet
                time.sleep(0.25)
        why = f"exited with code {proc.returncode}" if proc.poll() is not None else f"was not up in {timeout:.0f} s"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) or "(empty)"
        raise ServerStartError(f"{name} server {why}; last lines of {log}:\n{tail}")
    except BaseException:
        stop_process(proc)
        raise


def _prefect(port: int, home: str | os.PathLike | None, host: str, logs: str | os.PathLike):
    env = {**_ENV, **os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # the server must not talk to some other API while it starts
    # the API the UI's pages call: Prefect's default is port 4200 whatever --port says; a user's setting wins
    if "PREFECT_UI_API_URL" not in env:
        env.setdefault("PREFECT_SERVER_UI_API_URL", f"http://{_client_host(host)}:{port}/api")
    if home is not None:
        Path(home).mkdir(parents=True, exist_ok=True)
        env["PREFECT_HOME"] = str(Path(home).resolve())
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port), "--analytics-off"]
    return _spawn("Prefect", cmd, env, host, port, "/api", logs)


def _mlflow(port: int, backend_store_uri: str | None, host: str, artifacts: str | os.PathLike | None,
            logs: str | os.PathLike):
    store = backend_store_uri or f"sqlite:///{Path('runs', 'mlflow.db').resolve()}"
    # a sqlite db's directory must exist, and holds the artifacts by default; other stores default to ./runs
    db = Path(store.removeprefix("sqlite:///") if store.startswith("sqlite:///") else "runs/mlflow.db")
    db.parent.mkdir(parents=True, exist_ok=True)
    dest = Path(artifacts or db.parent / "mlartifacts").resolve()
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port), "--backend-store-uri",
           store, "--artifacts-destination", str(dest), "--workers", "1"]
    return _spawn("MLflow", cmd, {**_ENV, **os.environ}, host, port, "", logs)


def start_prefect_server(port: int, home: str | os.PathLike | None = None, host: str = LOOPBACK, *,
                         logs: str | os.PathLike = DEFAULT_LOGS, timeout: float = 60.0) -> tuple[str, subprocess.Popen]:
    """`prefect server start` with PREFECT_HOME=`home` (holds its sqlite database) when given; returns (API URL
    ending in /api, process) once /api/health answers."""
    return _wait("Prefect", *_prefect(port, home, host, logs), timeout)


def start_mlflow_server(port: int, backend_store_uri: str | None = None, host: str = LOOPBACK, *,
                        artifacts: str | os.PathLike | None = None, logs: str | os.PathLike = DEFAULT_LOGS,
                        timeout: float = 60.0) -> tuple[str, subprocess.Popen]:
    """`mlflow server` on `backend_store_uri` (default sqlite:///<cwd>/runs/mlflow.db), artifacts proxied to
    `artifacts` (default `mlartifacts` next to a sqlite db, else ./runs/mlartifacts); returns (tracking URI,
    process) once /health answers."""
    return _wait("MLflow", *_mlflow(port, backend_store_uri, host, artifacts, logs), timeout)


@dataclass
class UIProcesses:
    """The two running servers; PREFECT_API_URL must be set to `prefect_api_url`, `prefect_url` is its UI."""

    prefect_url: str
    prefect_api_url: str
    mlflow_url: str
    prefect: subprocess.Popen
    mlflow: subprocess.Popen
    logs: Path

    def stop(self, timeout: float = 10.0) -> None:
        """Stop both servers (idempotent)."""
        stop_process(self.mlflow, timeout)
        stop_process(self.prefect, timeout)

    def alive(self) -> bool:
        return self.prefect.poll() is None and self.mlflow.poll() is None

    def __enter__(self) -> UIProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_ui(prefect_port: int = 4200, mlflow_port: int = 5000, host: str = LOOPBACK,
             backend_store_uri: str | None = None, home: str | os.PathLike | None = None,
             logs: str | os.PathLike = DEFAULT_LOGS, artifacts: str | os.PathLike | None = None,
             timeout: float = 90.0) -> UIProcesses:
    """Start both servers at once (see start_prefect_server, start_mlflow_server) and wait for both; on
    ServerStartError neither is left running."""
    started = []
    try:
        started.append(("Prefect", *_prefect(prefect_port, home, host, logs)))
        started.append(("MLflow", *_mlflow(mlflow_port, backend_store_uri, host, artifacts, logs)))
        (api, prefect), (uri, mlflow) = [_wait(*s, timeout) for s in started]
    except BaseException:
        for _, _, proc, _ in started:
            stop_process(proc)
        raise
    return UIProcesses(api.removesuffix("/api"), api, uri, prefect, mlflow, Path(logs).resolve())


def serve_forever(ui: UIProcesses) -> int:
    """Print the URLs and client settings, block (main thread) until Ctrl-C, SIGTERM or a server exiting, stop
    both. Returns 0 after Ctrl-C/SIGTERM, 1 if a server exited by itself."""
    print(f"Prefect UI: {ui.prefect_url}\nMLflow UI:  {ui.mlflow_url}\nlogs:       {ui.logs}\n\n"
          "Point clients at them (in the shells that run `longstraw train`, `prefect worker start`, ...):\n"
          f"  export PREFECT_API_URL={ui.prefect_api_url}\n  export MLFLOW_TRACKING_URI={ui.mlflow_url}\n"
          f"Training runs log to this MLflow server when their TrainConfig sets `tracking: {{uri: {ui.mlflow_url}}}`"
          "\n(without it a run logs to sqlite under its run directory).\n\nPress Ctrl-C to stop both servers.",
          flush=True)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM: a KeyboardInterrupt too
    try:
        while ui.alive():
            time.sleep(1.0)
        dead = "Prefect" if ui.prefect.poll() is not None else "MLflow"
        print(f"{dead} server exited by itself; see its log in {ui.logs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping servers ...", flush=True)
        ui.stop()
        signal.signal(signal.SIGTERM, previous)
