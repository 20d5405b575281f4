"""Servers the tests start in-process, and requests to them."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

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


def put(client: TestClient, body: dict | bytes) -> tuple[int, dict]:
    """Megatron's PUT /api request: (status, answer)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.put("/api", content=content, headers={"Content-Type": "application/json"})
    return response.status_code, response.json()


def serve(monkeypatch, argv: list[str]) -> TestClient:
    """run_text_generation_server.main(argv) up to the app it would hand uvicorn, as a test client."""
    from megatron_train.tools import run_text_generation_server

    served = {}
    monkeypatch.setattr(run_text_generation_server.uvicorn, "run", lambda app, **_: served.update(app=app))
    run_text_generation_server.main(argv)
    return TestClient(served["app"])
