"""Servers the tests start (an app served by uvicorn in a thread), requests to them and the generation server's
health probe."""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.request
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.helpers.distributed import free_port
from tests.helpers.readiness import wait_until_ready


@contextlib.contextmanager
def uvicorn_serving(app: FastAPI) -> Iterator[str]:
    """`app` served by a real uvicorn server on 127.0.0.1 and a free port ("127.0.0.1:PORT"), stopped after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until_ready(lambda: server.started, "uvicorn serving the app in a thread", timeout=60)
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


def generation_server_healthy(port: int) -> bool:
    """Whether the text generation server on 127.0.0.1:`port` answers GET /health with status ok."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
        return json.loads(response.read())["status"] == "ok"
