"""Waiting for a server a test started: one overall deadline, and every kind of failure retried until it.

A busy 2-core machine makes a freshly started server slow in every way: it refuses connections, then accepts
one and answers late (a read timeout), resets it, or answers with an error while it finishes starting. Each of
those only means "not yet", so the probe is retried until the deadline; only a server process that exited, or
the deadline, ends the wait.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

POLL_SECONDS = 0.2


def wait_until_ready(
    probe: Callable[[], bool],
    what: str,
    timeout: float = 180.0,
    process: subprocess.Popen | None = None,
    output: Callable[[], str] = lambda: "",
) -> None:
    """Call `probe` until it returns True; any exception it raises counts as not ready yet. Fails naming `what`,
    the last failure and `output()` (e.g. the server's log) when `process` exits or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    last = "the probe answered not ready"
    while True:
        if process is not None and process.poll() is not None:
            raise AssertionError(
                f"{what} exited with status {process.returncode} before it was ready\n{output()}"
            )
        try:
            if probe():
                return
        except Exception as error:  # noqa: BLE001 - refused, reset, timed out, half-started: all mean not yet
            last = f"{type(error).__name__}: {error}"
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} was not ready within {timeout:.0f} s (last: {last})\n{output()}")
        time.sleep(POLL_SECONDS)
