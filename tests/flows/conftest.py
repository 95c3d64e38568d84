"""Prefect runs in these tests use a private PREFECT_HOME (its own sqlite database) and never reach the network."""

import os
import tempfile

os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="longstraw-prefect-home-")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"  # a loaded 2-core CI box starts slowly
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
