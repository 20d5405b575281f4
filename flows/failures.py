"""How a flow's command line ends on a failure: one line naming the stage and what to do, not a traceback.

A stage that fails inside a flow raises `StageFailed` from `flows.tasks.stage_ref` (and from the look-up of a
command line with nothing to do); `command_line` prints it, or a store that cannot be written
(`storage.artifacts.StoreNotWritable`), as one line ``error: ...`` and exits with status 1. While a flow runs,
Prefect's console log shows its records without tracebacks (`console_without_tracebacks`); the records that go
to the Prefect server keep them, so the flow run's log in the UI (or `prefect flow-run logs ID`) still has the
whole traceback. Importing this module does not import Prefect.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Iterator

from storage.artifacts import StoreNotWritable


class StageFailed(Exception):
    """A stage of a flow failed; the message is the stage's name and the first line of its error."""

    def __init__(self, stage: str, error: BaseException):
        self.stage, self.error = stage, error
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        super().__init__(f"the {stage} stage failed: {message}")


def command_line(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """A flow's `main` that ends on a failed stage or an unwritable store with one line on stderr, status 1."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except (StageFailed, StoreNotWritable) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1

    return run


class _WithoutTraceback(logging.Formatter):
    """Formats a record as `formatter` does, leaving out its traceback (the record itself is not changed)."""

    def __init__(self, formatter: logging.Formatter):
        super().__init__()
        self.formatter = formatter

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.formatter.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


@contextlib.contextmanager
def console_without_tracebacks() -> Iterator[None]:
    """While it lasts, Prefect's console handlers (`PrefectConsoleHandler`, on the root logger) print records
    without their tracebacks; `flows.server.prefect_api` enters it, so every flow command line does."""
    import prefect.main  # noqa: F401 - configures Prefect's logging, console handler included

    wrapped = [
        handler
        for handler in logging.getLogger().handlers
        if type(handler).__name__ == "PrefectConsoleHandler"
        and not isinstance(handler.formatter, _WithoutTraceback)
    ]
    originals = [handler.formatter for handler in wrapped]
    for handler, formatter in zip(wrapped, originals, strict=True):
        handler.setFormatter(_WithoutTraceback(formatter or logging.Formatter()))
    try:
        yield
    finally:
        for handler, formatter in zip(wrapped, originals, strict=True):
            handler.setFormatter(formatter)
