"""Start a Prefect server and an MLflow server for one machine, from this same environment.

`start_ui()` launches both as subprocesses (`python -m prefect server start`, `python -m mlflow server`), bound to
127.0.0.1 unless another host is passed explicitly, waits until both answer their health endpoints and returns a
`UIProcesses` with the URLs, the process handles and `stop()`. `serve_forever(ui)` prints how to point clients at
them and blocks until Ctrl-C. Server output goes to log files, whose tail is quoted when a server fails to come up.

For a long-lived setup (systemd units, a worker on a work pool) see infra/README.md.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"
DEFAULT_LOGS = Path("runs") / "ui-logs"
DEFAULT_MLFLOW_DB = Path("runs") / "mlflow.db"


class ServerStartError(RuntimeError):
    """A server exited or did not answer its health check in time; the message holds the tail of its log."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on `host` right now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((_client_host(host), port)) == 0


def _client_host(host: str) -> str:
    """The address a local client uses to reach a server bound to `host` (a wildcard bind is reached on loopback)."""
    return LOOPBACK if host in ("0.0.0.0", "", "::") else host


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(log {path} unreadable: {e})"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def _spawn(cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n".encode())
        out.flush()
        # own session/process group: both servers start children (uvicorn workers, services), and stop() must
        # reach those too
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, start_new_session=(os.name == "posix"))


def _stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process (and its process group), then SIGKILL whatever is left after `timeout` seconds."""
    if proc.poll() is not None:
        return
    posix = os.name == "posix"

    def send(sig: int) -> None:
        try:
            if posix:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    send(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL if posix else signal.SIGTERM)
        proc.wait(timeout)
    if posix:  # children that outlived the leader (the group id stays the leader's pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# health checks go straight to the (local) server, never through an http_proxy from the environment
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _wait_healthy(name: str, proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"{name} exited with code {proc.returncode} before answering {url}; "
                                   f"last lines of {log}:\n{_tail(log)}")
        try:
            with _DIRECT.open(url, timeout=2) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            last = str(getattr(e, "reason", e))
        time.sleep(0.25)
    raise ServerStartError(f"{name} did not answer {url} within {timeout:.0f} s ({last}); "
                           f"last lines of {log}:\n{_tail(log)}")


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("DO_NOT_TRACK", "true")
    # MLflow's job runner (GenAI judge/optimisation jobs; seven huey consumer processes) is not used by LongStraw
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    return env


def _launch(name: str, cmd: list[str], env: dict[str, str], log: Path, health: str, timeout: float) -> subprocess.Popen:
    """Start a server and wait until `health` answers; a server that does not come up is stopped again."""
    proc = _spawn(cmd, env, log)
    try:
        _wait_healthy(name, proc, health, log, timeout)
    except BaseException:
        _stop(proc)
        raise
    return proc


def start_prefect_server(port: int, home: str | os.PathLike | None = None, host: str = LOOPBACK, *,
                         logs: str | os.PathLike = DEFAULT_LOGS, timeout: float = 60.0
                         ) -> tuple[str, subprocess.Popen]:
    """Start `prefect server start --host HOST --port PORT` (analytics off; PREFECT_HOME=`home` when given, which
    also holds the server's sqlite database) and wait for GET /api/health. Returns (API URL ending in /api, the
    process). Stop it with `stop_process(proc)`."""
    if _port_in_use(host, port):
        raise ServerStartError(f"port {port} on {host} is already in use; pick another Prefect port")
    env = _base_env()
    if home is not None:
        Path(home).mkdir(parents=True, exist_ok=True)
        env["PREFECT_HOME"] = str(Path(home).resolve())
    # the server must not try to talk to some other API while it starts
    env.pop("PREFECT_API_URL", None)
    log = Path(logs).resolve() / "prefect-server.log"
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port),
           "--analytics-off"]
    api = f"http://{_client_host(host)}:{port}/api"
    return api, _launch("Prefect server", cmd, env, log, f"{api}/health", timeout)


def start_mlflow_server(port: int, backend_store_uri: str | None = None, host: str = LOOPBACK, *,
                        artifacts: str | os.PathLike | None = None, logs: str | os.PathLike = DEFAULT_LOGS,
                        workers: int = 1, timeout: float = 60.0) -> tuple[str, subprocess.Popen]:
    """Start `mlflow server` on HOST:PORT with `backend_store_uri` (default: sqlite under ./runs/mlflow.db) and
    artifacts proxied to `artifacts` (default: `mlartifacts` next to a sqlite store, else ./runs/mlartifacts);
    wait for GET /health. Returns (tracking URI, the process)."""
    if _port_in_use(host, port):
        raise ServerStartError(f"port {port} on {host} is already in use; pick another MLflow port")
    if backend_store_uri is None:
        db = DEFAULT_MLFLOW_DB.resolve()
        backend_store_uri = f"sqlite:///{db}"
    if artifacts is None:
        if backend_store_uri.startswith("sqlite:///"):
            artifacts = Path(backend_store_uri.removeprefix("sqlite:///")).parent / "mlartifacts"
        else:
            artifacts = Path("runs") / "mlartifacts"
    if backend_store_uri.startswith("sqlite:///"):
        Path(backend_store_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    artifacts_dir = Path(artifacts).resolve()
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    log = Path(logs).resolve() / "mlflow-server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port),
           "--backend-store-uri", backend_store_uri, "--artifacts-destination", str(artifacts_dir),
           "--workers", str(workers)]
    uri = f"http://{_client_host(host)}:{port}"
    return uri, _launch("MLflow server", cmd, _base_env(), log, f"{uri}/health", timeout)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Terminate a server started here (its whole process group), killing it after `timeout` seconds."""
    _stop(proc, timeout)


@dataclass
class UIProcesses:
    """The two running servers. `prefect_api_url` is what PREFECT_API_URL must be set to; `prefect_url` is the UI."""

    prefect_url: str
    prefect_api_url: str
    mlflow_url: str
    prefect: subprocess.Popen
    mlflow: subprocess.Popen
    logs: Path
    _stopped: bool = field(default=False, repr=False)

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate both servers, then kill whatever did not exit within `timeout` seconds. Idempotent."""
        for proc in (self.mlflow, self.prefect):
            _stop(proc, timeout)
        self._stopped = True

    def alive(self) -> bool:
        return self.prefect.poll() is None and self.mlflow.poll() is None

    def __enter__(self) -> "UIProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_ui(prefect_port: int = 4200, mlflow_port: int = 5000, host: str = LOOPBACK,
             backend_store_uri: str | None = None, home: str | os.PathLike | None = None,
             logs: str | os.PathLike = DEFAULT_LOGS, artifacts: str | os.PathLike | None = None,
             timeout: float = 90.0) -> UIProcesses:
    """Start a Prefect server and an MLflow server (concurrently) and wait until both are healthy.

    host: the interface both bind to; 127.0.0.1 unless set otherwise on purpose (neither server has
    authentication here). backend_store_uri: MLflow's store, default sqlite:///<cwd>/runs/mlflow.db. home:
    PREFECT_HOME for the Prefect server (its sqlite database lives there); default: the inherited one (~/.prefect).
    logs: directory of prefect-server.log and mlflow-server.log. Raises ServerStartError (with the failing
    server's log tail) if either does not come up within `timeout` seconds; then neither is left running.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        pf = pool.submit(start_prefect_server, prefect_port, home, host, logs=logs, timeout=timeout)
        mf = pool.submit(start_mlflow_server, mlflow_port, backend_store_uri, host, artifacts=artifacts, logs=logs,
                         timeout=timeout)
        errors = []
        results = {}
        for name, fut in (("prefect", pf), ("mlflow", mf)):
            try:
                results[name] = fut.result()
            except BaseException as e:  # noqa: BLE001 - both are joined before anything is raised
                errors.append(e)
    if errors:
        for _, proc in results.values():
            _stop(proc)
        raise errors[0]
    api, pproc = results["prefect"]
    muri, mproc = results["mlflow"]
    return UIProcesses(prefect_url=api.removesuffix("/api"), prefect_api_url=api, mlflow_url=muri, prefect=pproc,
                       mlflow=mproc, logs=Path(logs).resolve())


def describe(ui: UIProcesses) -> str:
    """What to print for users: the two URLs and how to point the CLI, workers and training runs at them."""
    return "\n".join([
        f"Prefect UI:  {ui.prefect_url}",
        f"MLflow UI:   {ui.mlflow_url}",
        f"logs:        {ui.logs}",
        "",
        "Point clients at these servers (in the shell that runs `longstraw train`, `prefect worker start`, ...):",
        f"  export PREFECT_API_URL={ui.prefect_api_url}",
        f"  export MLFLOW_TRACKING_URI={ui.mlflow_url}        # for MLflow clients and scripts",
        f"LongStraw training runs log to this MLflow server when their TrainConfig sets `tracking: {{uri: "
        f"{ui.mlflow_url}}}`",
        "(without it a run logs to sqlite under its run directory).",
    ])


def serve_forever(ui: UIProcesses, poll_seconds: float = 1.0) -> int:
    """Print the URLs and client settings, then block until Ctrl-C (or SIGTERM, or a server exiting); stop both.
    Returns 0 after Ctrl-C/SIGTERM, 1 if a server exited by itself."""
    print(describe(ui), flush=True)
    print("\nPress Ctrl-C to stop both servers.", flush=True)
    code = 0
    previous = None
    if os.name == "posix":
        def _term(_sig, _frame):
            raise KeyboardInterrupt
        try:
            previous = signal.signal(signal.SIGTERM, _term)
        except ValueError:  # not the main thread
            previous = None
    try:
        while code == 0:
            for name, proc in (("Prefect server", ui.prefect), ("MLflow server", ui.mlflow)):
                if proc.poll() is not None:
                    log = ui.logs / ("prefect-server.log" if proc is ui.prefect else "mlflow-server.log")
                    print(f"{name} exited with code {proc.returncode}; last lines of {log}:\n{_tail(log)}",
                          file=sys.stderr, flush=True)
                    code = 1
                    break
            else:
                time.sleep(poll_seconds)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping servers ...", flush=True)
        ui.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return code


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.ui`: the same as `longstraw ui`."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m flows.ui", description=__doc__.splitlines()[0])
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument("--mlflow-port", type=int, default=5000)
    p.add_argument("--host", default=LOOPBACK, help="interface to bind (default 127.0.0.1; no authentication)")
    p.add_argument("--backend-store-uri", default=None, help="MLflow store (default sqlite:///./runs/mlflow.db)")
    p.add_argument("--home", default=None, help="PREFECT_HOME of the Prefect server (default: inherited)")
    p.add_argument("--logs", default=str(DEFAULT_LOGS))
    a = p.parse_args(argv)
    try:
        ui = start_ui(a.prefect_port, a.mlflow_port, a.host, a.backend_store_uri, a.home, a.logs)
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return serve_forever(ui)


if __name__ == "__main__":
    sys.exit(main())
