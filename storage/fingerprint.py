"""Fingerprints: content hashes of files and canonical hashes of parameters and sources.

A stage's output key fingerprints everything that determines it (docs/architecture.md, stage contract), so
these functions must be stable across runs, processes and machines: canonical JSON, xxh3-128 hex digests.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
from typing import Any

import fsspec
import xxhash

_CHUNK = 8 << 20

# Keys under which fsspec implementations report a modification time or an entity tag.
_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "created")
_ETAG_KEYS = ("ETag", "etag", "md5Hash", "crc32c", "checksum")


def hash_bytes(data: bytes) -> str:
    """xxh3-128 hex digest of `data`."""
    return xxhash.xxh3_128_hexdigest(data)


def hash_file(path: str, fs: fsspec.AbstractFileSystem | None = None) -> str:
    """xxh3-128 hex digest of a file's content, streamed in 8 MiB chunks (any fsspec URL)."""
    if fs is None:
        fs, path = fsspec.core.url_to_fs(path)
    digest = xxhash.xxh3_128()
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hash_path(path: str, names: list[str] | None = None) -> str:
    """Content hash of a local file or folder (its files by relative name: all of them, or `names`); a name
    that is no path (a hub model name, say) stays that name."""
    if os.path.isfile(path):
        return hash_file(path)
    if os.path.isdir(path):
        if names is None:
            names = [
                os.path.relpath(os.path.join(root, name), path)
                for root, _, files in os.walk(path)
                for name in files
            ]
        return hash_bytes(
            canonical_json({name: hash_file(os.path.join(path, name)) for name in sorted(names)}).encode()
        )
    return path


def _plain(obj: Any) -> Any:
    """Turn dataclasses, pydantic models, paths, enums, tuples and sets into JSON-able plain values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if hasattr(obj, "model_dump"):
        return _plain(obj.model_dump())
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(_plain(v) for v in obj)
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return _plain(obj.value)
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(
        f"cannot fingerprint a {type(obj).__name__}: use plain values, dataclasses or pydantic models"
    )


def canonical_json(obj: Any) -> str:
    """Compact JSON with sorted keys: equal values give equal strings."""
    return json.dumps(_plain(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def fingerprint_params(params: Any) -> str:
    return hash_bytes(canonical_json(params).encode())


def _describe(info: dict[str, Any]) -> dict[str, Any]:
    described: dict[str, Any] = {"size": info.get("size")}
    for key in _MTIME_KEYS:
        if info.get(key) is not None:
            described["mtime"] = str(info[key])
            break
    for key in _ETAG_KEYS:
        if info.get(key) is not None:
            described["etag"] = str(info[key]).strip('"')
            break
    return described


def source_files(url: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The files an external source names: a file, a directory (recursively) or a glob; sorted."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    if fsspec.core.has_magic(path):
        paths = sorted(p for p in fs.glob(path) if fs.isfile(p))
    elif fs.isdir(path):
        paths = sorted(fs.find(path))
    elif fs.exists(path):
        paths = [path]
    else:
        paths = []
    if not paths:
        raise FileNotFoundError(f"source {url!r} matches no file: check the path, glob or URL")
    return fs, paths


def source_fingerprint(url: str, **storage_options: Any) -> str:
    """URL plus what fsspec reports (size, mtime, ETag) of every file it names.

    A scheduled refresh then sees a changed source as a new key and an unchanged one as a cache hit,
    without reading the data.
    """
    fs, paths = source_files(url, **storage_options)
    files = {p: _describe(fs.info(p)) for p in paths}
    return hash_bytes(canonical_json({"url": url, "files": files}).encode())
