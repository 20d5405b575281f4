"""Under CI=true a skipped test fails the run: a skip there means a package the lock pins is not installed or a
file of ../shared is missing, and the test it hides would otherwise pass unseen. Skips for a CUDA device (their
reason names CUDA or a GPU) are excepted: CI has none. Without CI=true (a user's fresh clone) skips stay skips.

The run still runs every test; the skips are listed in their own section and the exit status is 1.
"""

from __future__ import annotations

import os
import re

import pytest

DEVICE_SKIP = re.compile(r"\b(CUDA|GPU)\b")


class SkipsFailInCI:
    """Collects the skips CI does not allow (at collection and at run time) and fails the session on them."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    def _check(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not DEVICE_SKIP.search(reason):
            self.refused.append(f"{report.nodeid}: {reason}")

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._check(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._check(report)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.refused:
            terminalreporter.section(
                "CI=true: skips fail the run (install the package or add the file)", red=True
            )
            for line in self.refused:
                terminalreporter.write_line(line)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.refused and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        config.pluginmanager.register(SkipsFailInCI(), "skips-fail-in-ci")
