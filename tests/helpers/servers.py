"""Servers the tests start in-process."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from tests.helpers.distributed import free_port


@contextlib.contextmanager
def uvicorn_serving(app: FastAPI) -> Iterator[str]:
    """`app` served by a real uvicorn server on 127.0.0.1 and a free port ("127.0.0.1:PORT"), stopped after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start within 30 s"
        time.sleep(0.05)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
