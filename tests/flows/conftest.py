"""Prefect runs in these tests use a private PREFECT_HOME (its own sqlite database) and never reach the network.

The `longstraw` commands the tests start talk to one Prefect server started here for the session (PREFECT_API_URL),
as a user's runs talk to `longstraw ui`'s: without it each command starts a temporary server of its own, 5-10 s a
command on a 2-core box. Tests that need a server of their own (test_serve, test_ui_browser) set the URL
themselves; the in-process flows of a test keep Prefect's ephemeral server (settings are read at import)."""

import os
import tempfile
from collections.abc import Iterator

import pytest

from flows.ui import free_port, start_prefect_server, stop_process

os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="longstraw-prefect-home-")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"  # a loaded 2-core CI box starts slowly
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[str]:
    """The session's Prefect server on loopback; its API URL."""
    home = os.environ["PREFECT_HOME"]
    api, proc = start_prefect_server(free_port(), home, logs=home, timeout=180)
    try:
        yield api
    finally:
        stop_process(proc)


@pytest.fixture(autouse=True)
def _commands_use_the_session_server(prefect_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PREFECT_API_URL in the environment of the commands a test here starts (only here: tests elsewhere, the
    README's commands among them, run as on a fresh machine)."""
    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
