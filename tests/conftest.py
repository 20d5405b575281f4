"""Shared fixtures: one Prefect test server for the whole session (it takes 10 to 60 s to start)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.helpers.distributed import free_port

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def prefect_api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prefect server for flow tests; yields its API URL so subprocesses can use it too."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible server (moto_server) on 127.0.0.1, reached through s3fs."""
    pytest.importorskip("s3fs")
    server = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(server):
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    port = free_port()
    proc = subprocess.Popen(
        [server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    import requests

    for _ in range(100):
        try:
            requests.get(endpoint, timeout=1)
            break
        except requests.ConnectionError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("moto_server did not start")
    yield endpoint
    proc.kill()
    proc.wait()
