"""The Prefect API server the flow tests share: what `prefect_test_harness` starts (uvicorn on Prefect's app, a
SQLite database of its own, the UI off), waited for with `wait_until_ready` instead of the harness's own loop,
which retries only refused connections and so fails on a slow first answer (`httpx.ReadTimeout`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_SERVER_DATABASE_CONNECTION_URL,
    get_current_settings,
    temporary_settings,
)

from tests.helpers.distributed import free_port
from tests.helpers.readiness import wait_until_ready


@contextlib.contextmanager
def prefect_test_server(directory: Path) -> Iterator[str]:
    """A Prefect API server on 127.0.0.1 with its database in `directory`; yields its API URL, which Prefect's
    settings point at until the server stops (logs and events sent to it are drained first, as the harness does)."""
    database = f"sqlite+aiosqlite:///{directory / 'prefect-test.db'}"
    with temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: database}):
        settings = get_current_settings().to_environment_variables(exclude_unset=True)
    env = {**os.environ, **settings, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1"}
    port = free_port()
    log = directory / "server.log"
    with open(log, "w") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app", "--host",
             "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"],
            env=env, stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    api_url = f"http://127.0.0.1:{port}/api"
    try:
        wait_until_ready(
            lambda: httpx.get(f"{api_url}/health", timeout=10).status_code == 200,
            "the Prefect test server",
            process=server,
            output=lambda: log.read_text()[-3000:],
        )
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            yield api_url
            APILogWorker.drain_all()
            EventsWorker.drain_all()
    finally:
        server.terminate()
        server.wait(30)
