"""Shared fixtures: one Prefect test server for the whole session (it takes 10 to 60 s to start) and one S3
server (moto), each waited for with one deadline (tests/helpers/readiness.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.helpers.distributed import free_port
from tests.helpers.readiness import wait_until_ready

pytest_plugins = ("pytester", "tests.helpers.ci_skips", "tests.helpers.process_guard")

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two test processes on the cores: one thread each, and for the processes they start, or
    # OpenMP threads spinning in one stall the other (a 17 s one-process training test ran past 600 s).
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first, each file's tests in their order: the files holding a test marked slow, then the others
    by their number of tests (xdist's own order, which `make test` turns off with --no-loadscope-reorder because it
    put the two-minute Prefect deployment test, one test in its file, last, to end the run alone)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    tests_in = Counter(item.path for item in items)
    items.sort(key=lambda item: (item.path not in slow_files, -tests_in[item.path]))


@pytest.fixture(scope="session")
def prefect_api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prefect server for flow tests; yields its API URL so subprocesses can use it too."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    from tests.helpers.prefect_server import prefect_test_server  # imports Prefect: only for the flow tests

    with prefect_test_server(home) as api_url:
        yield api_url


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible server (moto_server) on 127.0.0.1, reached through s3fs."""
    pytest.importorskip("s3fs")
    beside_python = os.path.join(
        os.path.dirname(sys.executable), "moto_server"
    )  # this venv's, not one on PATH
    server = beside_python if os.path.exists(beside_python) else shutil.which("moto_server")
    if server is None:
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    port = free_port()
    proc = subprocess.Popen(
        [server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    import requests

    try:  # any HTTP answer means it serves; its first one can take seconds on a busy machine
        wait_until_ready(lambda: requests.get(endpoint, timeout=10) is not None, "moto_server", process=proc)
        yield endpoint
    finally:
        proc.kill()
        proc.wait()
