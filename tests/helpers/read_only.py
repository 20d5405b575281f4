"""A folder made read-only for this process, whoever runs the tests: root ignores file modes (and CI runs as root),
so for root the folder is bind-mounted onto itself read-only; for anyone else its mode loses the write bits."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[str]:
    """While it lasts, nothing can be written under `folder`; yields the reason a write fails (strerror)."""
    if os.geteuid() != 0:
        modes = {path: path.stat().st_mode for path in (folder, *folder.rglob("*")) if path.is_dir()}
        for path in modes:
            path.chmod(0o555)
        try:
            yield "Permission denied"
        finally:
            for path, mode in modes.items():
                path.chmod(mode)
        return
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield "Read-only file system"
    finally:
        subprocess.run(["umount", str(folder)], check=True)
