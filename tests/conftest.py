"""Shared fixtures: one Prefect test server for the whole session (it takes 10 to 60 s to start)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

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
