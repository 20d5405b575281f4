"""The Prefect API a flow's command line talks to, and the rule that its helper processes die with it.

With ``PREFECT_API_URL`` set, flows use that server. Without it, Prefect would start a temporary server on
the sqlite database under ``PREFECT_HOME`` by itself; two flows started at once then both migrate and write
that one file ("database is locked"), and a SIGKILL of the flow leaves the server running. `prefect_api`
starts the temporary server instead (docs/architecture.md):

- the first flow process takes the lock file ``<PREFECT_HOME>/megatron-flow-server.lock`` and serves
  ``PREFECT_HOME``'s database (its run history is kept); a flow that finds the lock taken serves a database of
  its own in a temporary folder, deleted when it ends. The task cache does not depend on the database.
- the server process runs `exit_with_parent`, as do the ``processes`` task runner's workers, so a flow
  killed by SIGKILL leaves nothing running for more than a few seconds.

    python -m flows.server PORT    # the server process itself (what `prefect_api` starts)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx

from flows.failures import console_without_tracebacks
from storage.artifacts import try_lock

LOCK_FILE = "megatron-flow-server.lock"
STARTUP_TIMEOUT_SECONDS = 180.0  # a fresh database's migrations take a minute on a busy 2-core machine
# What Prefect's own temporary server sets (no UI, ephemeral mode), and no telemetry: the product runs without
# internet, and the telemetry service's first write races the flow's on the sqlite file ("database is locked").
_SERVER_ENV = {
    "PREFECT_UI_ENABLED": "0",
    "PREFECT__SERVER_EPHEMERAL": "1",
    "PREFECT__SERVER_FINAL": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


def exit_with_parent(
    parent: int | None = None, poll_seconds: float = 0.5, grace_seconds: float = 5.0
) -> None:
    """Stop this process once its parent is gone: SIGTERM to itself, then a hard exit after `grace_seconds`.

    A watchdog thread polls the parent's pid (it changes when the parent dies and the process is re-parented),
    which works whichever thread started the process, unlike Linux's PR_SET_PDEATHSIG. It is picklable as a
    process pool's `initializer`; give the parent's pid (`parent`) there, since a worker that starts after its
    parent died would otherwise take its new parent (init) for the one to watch.
    """
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_seconds)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the temporary Prefect server exited with status {proc.returncode} before it was ready; "
                    "its errors are printed above. Set PREFECT_API_URL to use a running server instead"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.2)
    raise RuntimeError(
        f"the temporary Prefect server at {url} did not answer within {timeout:.0f} s; start one with "
        "`prefect server start` and set PREFECT_API_URL, or retry on a less busy machine"
    )


@contextlib.contextmanager
def prefect_api(startup_timeout: float = STARTUP_TIMEOUT_SECONDS) -> Iterator[str]:
    """Yield the API URL flows in this process use: PREFECT_API_URL if set, else a temporary server's. While it
    lasts, Prefect's console log leaves tracebacks out (`flows.failures`: a failed flow ends in one line)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, get_current_settings, temporary_settings

    given = PREFECT_API_URL.value()
    if given:
        with console_without_tracebacks():
            yield given
        return
    home = str(PREFECT_HOME.value())
    os.makedirs(home, exist_ok=True)
    database = get_current_settings().server.database.connection_url  # None: sqlite under PREFECT_HOME
    shared_sqlite = database is None or "sqlite" in database.get_secret_value()
    lock = try_lock(os.path.join(home, LOCK_FILE)) if shared_sqlite else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(console_without_tracebacks())
        if lock is not None:
            stack.callback(lock.close)
        env = {**os.environ, **_SERVER_ENV}
        if shared_sqlite and lock is None:  # another flow serves PREFECT_HOME's sqlite file: use our own
            private = stack.enter_context(tempfile.TemporaryDirectory(prefix="prefect-db-"))
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{private}/prefect.db"
        port = _free_port()
        url = f"http://127.0.0.1:{port}/api"
        proc = subprocess.Popen([sys.executable, "-m", "flows.server", str(port)], env=env)
        stack.callback(_stop, proc)
        _wait_until_healthy(proc, url, startup_timeout)
        # Worker processes and subprocesses read the environment; this thread reads the settings context, and
        # threads Prefect starts later (the process pool's message forwarder) read the global one.
        stack.enter_context(_api_url_everywhere(url))
        stack.enter_context(temporary_settings(updates={PREFECT_API_URL: url}))
        # Runs first on the way out, while the URL is still set: the last logs and events reach the server
        # (drained without it, Prefect would start a temporary server to send them to).
        stack.callback(_drain_prefect_clients)
        yield url


@contextlib.contextmanager
def _api_url_everywhere(url: str) -> Iterator[None]:
    """PREFECT_API_URL in the environment and in Prefect's process-global settings, which a new thread reads
    (threads start without the caller's settings context); without the refresh, the process pool's
    message-forwarding thread finds no API URL and starts a temporary server of its own, left running."""
    from prefect.context import refresh_global_settings_context

    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    refresh_global_settings_context()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous
        refresh_global_settings_context()


def _drain_prefect_clients() -> None:
    """Send the logs and events Prefect still buffers in this process (what prefect_test_harness does)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    with contextlib.suppress(RuntimeError):  # raised when the worker never started
        APILogWorker.instance().drain()
    EventsWorker.drain_all()


def _stop(proc: subprocess.Popen, grace_seconds: float = 10.0) -> None:
    proc.terminate()
    try:
        proc.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Serve Prefect's API on 127.0.0.1:PORT until stopped or until the parent process dies."""
    (port,) = argv if argv is not None else sys.argv[1:]
    exit_with_parent()
    import uvicorn

    uvicorn.run(
        "prefect.server.api.server:create_app",
        factory=True,
        host="127.0.0.1",
        port=int(port),
        log_level="error",
        lifespan="on",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
