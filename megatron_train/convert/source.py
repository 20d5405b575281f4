"""Reading a converter's source folder without trusting it: every file it names is a regular file inside the
folder (a symlink is followed only while it stays inside), and a JSON file is size-bounded before it is parsed
(docs/architecture.md, checkpoints). A checkpoint is data from anywhere: a link in it must not make the converter
read, and copy into its output, a file of the machine it runs on.
"""

from __future__ import annotations

import json
import os
from typing import Any

MAX_JSON_BYTES = 64 << 20  # config.json, a weights index, a tokenizer config: kilobytes to a few megabytes


def inside(folder: str, path: str, what: str) -> str:
    """`path` (in `folder`), checked to be a regular file whose real path lies inside `folder`'s real path."""
    real_folder, real = os.path.realpath(folder), os.path.realpath(path)
    if os.path.commonpath([real_folder, real]) != real_folder:
        raise ValueError(
            f"{path}: {what} resolves to {real}, outside {folder}; a model folder's files must lie inside it "
            "(copy the file in instead of linking it)"
        )
    if not os.path.isfile(real):
        kind = "a folder" if os.path.isdir(real) else "missing" if not os.path.exists(real) else "not a file"
        raise ValueError(f"{path}: {what} is {kind}, not a regular file")
    return path


def member(folder: str, name: Any, what: str) -> str:
    """The path of file `name` of `folder`, where `name` comes from the folder's own metadata (a weights index,
    a tokenizer record): a plain file name, no folder part, then checked as `inside`."""
    if not isinstance(name, str) or not name or name in (".", "..") or os.path.basename(name) != name:
        raise ValueError(
            f"{folder}: {what} names {name!r}, which is not a file name in the folder (no folders, no '..')"
        )
    return inside(folder, os.path.join(folder, name), what)


def read_json(path: str, limit: int | None = None) -> Any:
    """A JSON file, refused unread when it is over `limit` bytes (default MAX_JSON_BYTES); a bad one is an error
    naming it."""
    limit = MAX_JSON_BYTES if limit is None else limit
    try:
        size = os.path.getsize(path)
        if size > limit:
            raise ValueError(
                f"{path}: {size} bytes, over the {limit} bytes a file of this kind may have; it is not the file it "
                "is named after"
            )
        with open(path, "rb") as handle:
            return json.loads(handle.read())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({error}); fetch or fix the file") from error


def read_json_object(path: str, limit: int | None = None) -> dict[str, Any]:
    """`read_json`, which must give a JSON object."""
    data = read_json(path, limit)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
