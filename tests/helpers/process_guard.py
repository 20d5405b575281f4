"""`make test-fast` (`-m "not processes"`) stays fast because a test that starts a process must say so: in such a
run, a test that starts a subprocess or a multiprocessing process (torchrun, a gloo group, a pool, a server) fails,
naming the marker to add. Only the tests are watched, not collection: imports may run a command of their own
(`platform.architecture()` runs `file`)."""

from __future__ import annotations

import multiprocessing.process
import subprocess
from collections.abc import Iterator

import pytest

MESSAGE = "this test starts a process ({}): mark it @pytest.mark.processes (make test-fast deselects those)"


def _refuse(what: str):
    def refuse(*args, **kwargs):
        pytest.fail(MESSAGE.format(what), pytrace=False)

    return refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if "not processes" not in (item.config.option.markexpr or ""):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child", _refuse("a subprocess"))
        mp.setattr(multiprocessing.process.BaseProcess, "start", _refuse("a multiprocessing process"))
        yield
