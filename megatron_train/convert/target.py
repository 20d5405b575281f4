"""Where a converter writes: `--save-dir` is built whole beside its final name and moved into place.

A conversion never writes into a folder that holds anything: another run's checkpoints there would be mixed with
this one (a new latest marker makes the next resume overwrite them), another model's shards would survive beside
the new ones. Such a folder is refused, naming what it holds, unless `--overwrite` asks to replace it whole. The
output is built in a temporary folder beside `--save-dir` and renamed into place (or swapped with the old folder)
only when complete, so a failed or killed conversion (a full disk, a read-only target, SIGKILL) leaves nothing
behind but that temporary folder's name pattern, which `storage.atomic.is_temporary` recognises
(docs/architecture.md, checkpoints).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
from collections.abc import Iterator

from safetensors import SafetensorError

from megatron_train.checkpointing.files import TRACKER_FILENAME, CheckpointError
from storage.atomic import TEMP_MARK, final_name, replacing_dir

logger = logging.getLogger(__name__)

LISTED = 5  # entries of a refused folder named in the message


def _what_it_holds(names: list[str]) -> str:
    if TRACKER_FILENAME in names or any(name.startswith(("iter_", "release")) for name in names):
        return "a run's checkpoints"
    if "config.json" in names or any(name.endswith(".safetensors") for name in names):
        return "a model's files"
    return "other files"


def check_target(save_dir: str, overwrite: bool, load_dir: str | None = None) -> None:
    """Refuse a `--save-dir` the converter must not write: `load_dir` or a folder holding it (replacing it would
    delete the source), a file, a mount point, or (without `overwrite`) a folder that holds anything. Cheap, so a
    conversion calls it before reading the source."""
    if load_dir is not None:
        source, target = os.path.realpath(load_dir), os.path.realpath(save_dir)
        if source == target:
            raise ValueError(f"--save-dir {save_dir} is --load-dir: write the converted checkpoint elsewhere")
        if os.path.commonpath([source, target]) == target:
            raise ValueError(
                f"--save-dir {save_dir} holds --load-dir {load_dir}: replacing it would delete the source; write the "
                "converted checkpoint elsewhere"
            )
    leftovers = glob.glob(glob.escape(os.path.realpath(save_dir)) + TEMP_MARK + "*")
    if leftovers:
        logger.warning(
            "%s: an interrupted conversion left %s; delete it once no conversion into %s runs",
            save_dir, ", ".join(sorted(leftovers)[:3]), save_dir,
        )  # fmt: skip
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ValueError(f"--save-dir {save_dir} is a file: pass a folder to write the converted model to")
    if not os.path.isdir(save_dir):
        return
    if os.path.ismount(os.path.realpath(save_dir)):
        raise ValueError(
            f"--save-dir {save_dir} is a mount point: the output is built beside the folder and renamed into "
            f"place, which a mount point cannot be; pass a folder inside it (--save-dir {save_dir}/model)"
        )
    names = sorted(os.listdir(save_dir))
    if names and not overwrite:
        shown = ", ".join(names[:LISTED]) + (
            f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
        )
        raise ValueError(
            f"--save-dir {save_dir} already holds {_what_it_holds(names)} ({shown}): writing into it would mix "
            "them with the converted model; pick a new or empty --save-dir, or pass --overwrite to replace the "
            "folder whole"
        )


def _free_bytes(save_dir: str) -> int | None:
    parent = os.path.dirname(os.path.abspath(save_dir))
    try:
        return shutil.disk_usage(parent).free
    except OSError:
        return None


@contextlib.contextmanager
def output_folder(save_dir: str, overwrite: bool = False, size_hint: int = 0) -> Iterator[str]:
    """Yield the folder to write `save_dir`'s files in (a new one beside it); when the block ends it becomes
    `save_dir`. A write that fails (disk full, read-only or vanished target, file size limit) removes it and
    ends in a CheckpointError naming --save-dir, the file and what to do. `size_hint`: the bytes the output
    will take, checked against the free space first."""
    check_target(save_dir, overwrite)
    free = _free_bytes(save_dir)
    if free is not None and size_hint > free:
        raise CheckpointError(
            f"--save-dir {save_dir}: the converted model needs about {size_hint / 1e6:.1f} MB, but its file "
            f"system has {free / 1e6:.1f} MB free; free space or pick another --save-dir"
        )
    final = os.path.realpath(save_dir)  # a symlinked --save-dir keeps its link; its target is replaced
    build = None
    try:
        with replacing_dir(final, replace=overwrite) as build:
            yield build
    except (OSError, SafetensorError) as error:
        raise write_error(save_dir, build, final, error) from error


def write_error(
    save_dir: str, build: str | None, final: str, error: OSError | SafetensorError
) -> CheckpointError:
    """One line for a failed write: the file (under its final name), the system's reason, what to do."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    filename = str(getattr(error, "filename", None) or "")
    what = "the converted model"
    if build and filename.startswith(build):
        what = final_name(os.path.join(save_dir, os.path.relpath(filename, build)))
    free = _free_bytes(save_dir)
    space = "" if free is None else f" ({free / 1e6:.1f} MB free there)"
    return CheckpointError(
        f"--save-dir {save_dir}: cannot write {what}: {reason}{space}; nothing was written. Free space, make the "
        "folder writable, or pick another --save-dir"
    )
