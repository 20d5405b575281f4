"""One way to write a local file so that readers see it complete or not at all (docs/architecture.md).

Every writer in the project goes through `atomic_path`: the bytes go to a temporary name beside the final
one (``<name>.tmp-<uuid>``, same directory, so same file system), are flushed to disk, then renamed into
place. A process killed mid-write leaves at most a temporary file, which `is_temporary` recognises so that
commits, listings and copies skip it; a finished file is never half-overwritten. A whole folder is built the
same way (`replacing_dir`): beside its final name, then renamed (or swapped) into place.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
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


def final_name(path: str) -> str:
    """The path a temporary file of `atomic_path` (or a folder of `replacing_dir`) is renamed to."""
    head, name = os.path.split(path)
    return os.path.join(head, name.split(TEMP_MARK)[0])


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


# renameat2's flag (Linux): swap two paths in one step. glibc >= 2.28 exports renameat2.
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap the folders `a` and `b` atomically; False where the system or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), b)


@contextlib.contextmanager
def replacing_dir(path: str, replace: bool = False) -> Iterator[str]:
    """Yield a new folder beside `path` to build in; on success it becomes `path`, on error it is removed.

    `path` must be absent or an empty folder unless `replace`, when an existing folder is swapped out in one
    step (renameat2's exchange; two renames where the file system lacks it) and then deleted: readers see the
    old folder or the new one, never a mix of both (no stale file of the old one survives)."""
    path = os.path.abspath(path)
    build = temporary_name(path)
    os.mkdir(build)
    try:
        yield build
        if replace and os.path.isdir(path) and os.listdir(path):
            old = temporary_name(path)
            if _exchange(build, path):
                os.rename(build, old)  # `build` now names the old folder
            else:
                os.rename(path, old)
                os.rename(build, path)
            shutil.rmtree(old)
        else:
            os.rename(build, path)  # replaces an empty folder; refuses one that filled meanwhile
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
