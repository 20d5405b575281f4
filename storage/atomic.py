"""One way to write a local file so that readers see it complete or not at all (docs/architecture.md).

Every writer in the project goes through `atomic_path`: the bytes go to a temporary name beside the final
one (``<name>.tmp-<uuid>``, same directory, so same file system), are flushed to disk, then renamed into
place. A process killed mid-write leaves at most a temporary file, which `is_temporary` recognises so that
commits, listings and copies skip it; a finished file is never half-overwritten.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator

TEMP_MARK = ".tmp-"


def temporary_name(path: str) -> str:
    """A fresh temporary name beside `path` (unique per writer, so concurrent writers never collide)."""
    return f"{path}{TEMP_MARK}{uuid.uuid4().hex}"


def is_temporary(name: str) -> bool:
    """True for a file an interrupted `atomic_path` left behind (judged by its base name)."""
    return TEMP_MARK in os.path.basename(name.rstrip("/"))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str, fsync: bool = True, exclusive: bool = False) -> Iterator[str]:
    """Yield a temporary path to write; on success it replaces `path`, on error it is removed.

    `fsync=False` skips the flush to disk for caches that can be rebuilt (the rename stays atomic).
    `exclusive=True` never replaces: the file is linked into place, and FileExistsError says another writer
    got there first (its file is kept; what first commits wins).
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = temporary_name(path)
    try:
        yield tmp
        if fsync:
            _fsync(tmp)
        if exclusive:
            os.link(tmp, path)
            os.remove(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def atomic_write_bytes(path: str, data: bytes, fsync: bool = True) -> None:
    with atomic_path(path, fsync) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(path: str, text: str, fsync: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), fsync)


def atomic_copy(src: str, dest: str, fsync: bool = True) -> None:
    """Copy `src` to `dest` so that `dest` appears complete or not at all."""
    with atomic_path(dest, fsync) as tmp:
        shutil.copyfile(src, tmp)


def atomic_move(src: str, dest: str) -> None:
    """Move a finished local file into place: a rename on the same device, else an atomic copy."""
    directory = os.path.dirname(os.path.abspath(dest))
    os.makedirs(directory, exist_ok=True)
    if os.stat(src).st_dev == os.stat(directory).st_dev:
        os.replace(src, dest)
    else:
        atomic_copy(src, dest)
        os.remove(src)
