"""Is a committed artifact still what its manifest says? (docs/architecture.md, "Verification")

A stage checks every file of each input artifact before it uses it: on a local store its size and xxh3 hash
against the manifest's, on an object store its size and ETag against the ones recorded at commit (a changed
object gets a new ETag). A file that passed is remembered by device, inode, mtime and size (by ETag on an object
store), so a run pays once per file. A mismatch is a `ChangedArtifactError` naming the file and the stage whose
artifact to rebuild. Files given to a stage by path (tokenizer files, an embedder folder) that lie in a committed
artifact are checked the same way when the stage's key hashes them (`content_hash`).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from typing import Any

import fsspec

from storage.fingerprint import canonical_json, hash_bytes, hash_file, hash_path

MANIFEST = "manifest.json"
CHECKSUM = "checksum"  # the manifest's own hash, of its other fields
READ_ONLY = 0o444  # a committed file's mode on a local store
_KEY = re.compile(r"[0-9a-f]{32}")  # an artifact folder's name (xxh3-128 hex)

_verified: dict[str, tuple[Any, ...]] = {}  # file path or URL -> what it looked like when it passed


class ChangedArtifactError(Exception):
    """A committed artifact's file is missing or differs from its manifest: the artifact must be rebuilt."""

    def __init__(self, path: str, problem: str, stage: str, url: str):
        self.path, self.stage = path, stage
        super().__init__(
            f"{path}: {problem}; the {stage} artifact {url} changed after it was committed: rebuild it "
            f"(--rebuild {stage})"
        )


def with_checksum(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its checksum field: a hash of the canonical JSON of every other field."""
    return {**manifest, CHECKSUM: hash_bytes(canonical_json(manifest).encode())}


def parse_manifest(data: bytes, where: str, stage: str, url: str) -> dict[str, Any]:
    """A manifest's fields, checked against its checksum (manifests written before checksums pass unchecked)."""
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ChangedArtifactError(where, f"not valid JSON ({error})", stage, url) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ChangedArtifactError(where, "not an artifact manifest (no files)", stage, url)
    if CHECKSUM in manifest:
        fields = {k: v for k, v in manifest.items() if k != CHECKSUM}
        if hash_bytes(canonical_json(fields).encode()) != manifest[CHECKSUM]:
            raise ChangedArtifactError(where, "its fields do not match its checksum", stage, url)
    return manifest


def check_local_file(path: str, record: dict[str, Any], stage: str, url: str) -> None:
    """`path` has the manifest record's size and hash (once per process while the file stays the same)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ChangedArtifactError(path, "the file is missing", stage, url) from None
    seen = (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)
    if _verified.get(path) == seen:
        return
    if info.st_size != record["size"]:
        problem = f"{info.st_size} bytes where its manifest says {record['size']}"
        raise ChangedArtifactError(path, problem, stage, url)
    if hash_file(path, fsspec.filesystem("file")) != record["hash"]:
        raise ChangedArtifactError(path, "its content differs from its manifest's hash", stage, url)
    _verified[path] = seen


def check_remote_file(
    fs: fsspec.AbstractFileSystem,
    path: str,
    info: dict[str, Any] | None,
    record: dict[str, Any],
    stage: str,
    url: str,
) -> None:
    """An object-store file against its manifest record: size and ETag when the record has one, else the hash."""
    where = f"{url.rstrip('/')}/{path.rsplit('/', 1)[-1]}" if info is None else info.get("name", path)
    if info is None:
        raise ChangedArtifactError(where, "the object is missing", stage, url)
    etag = _etag(info)
    seen = (info.get("size"), etag)
    if _verified.get(path) == seen:
        return
    if info.get("size") != record["size"]:
        problem = f"{info.get('size')} bytes where its manifest says {record['size']}"
        raise ChangedArtifactError(where, problem, stage, url)
    if "etag" in record and etag is not None:
        if etag != record["etag"]:
            raise ChangedArtifactError(where, "its ETag differs from the one recorded at commit", stage, url)
    elif hash_file(path, fs) != record["hash"]:
        raise ChangedArtifactError(where, "its content differs from its manifest's hash", stage, url)
    _verified[path] = seen


def _etag(info: dict[str, Any]) -> str | None:
    for key in ("ETag", "etag"):
        if info.get(key) is not None:
            return str(info[key]).strip('"')
    return None


def etag_of(info: dict[str, Any]) -> dict[str, str]:
    """{"etag": ...} of an object's info, or {} where the store reports none."""
    etag = _etag(info)
    return {} if etag is None else {"etag": etag}


def content_hash(path: str, names: list[str] | None = None) -> str:
    """`storage.fingerprint.hash_path` of a file or folder given by path, with every file that lies in a committed
    artifact checked against its manifest first (and its hash taken from there): a stage keyed on a changed
    tokenizer file of the train_tokenizer artifact refuses instead of building on it."""
    if os.path.isdir(path):
        if names is None:
            names = [
                os.path.relpath(os.path.join(root, name), path)
                for root, _, files in os.walk(path)
                for name in files
            ]
        hashes = {name: content_hash(os.path.join(path, name)) for name in sorted(names)}
        return hash_bytes(canonical_json(hashes).encode())
    found = _committed_record(path)
    if found is None:
        return hash_path(path)
    record, stage, url = found
    fs, local = fsspec.core.url_to_fs(path)
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        check_local_file(local, record, stage, url)
    else:
        check_remote_file(fs, local, fs.info(local) if fs.exists(local) else None, record, stage, url)
    return record["hash"]


def _committed_record(path: str) -> tuple[dict[str, Any], str, str] | None:
    """(manifest record, stage, artifact URL) of a file inside a committed artifact (a folder named like a key
    holding a manifest that lists the file), else None."""
    if "://" not in path and not os.path.isfile(path):
        return None
    fs, local = fsspec.core.url_to_fs(path)
    folder = posixpath.dirname(local)
    while folder not in ("", "/") and not _KEY.fullmatch(posixpath.basename(folder)):
        folder = posixpath.dirname(folder)
    if folder in ("", "/") or not fs.exists(f"{folder}/{MANIFEST}"):
        return None
    url = path[: len(path) - len(local)] + folder if "://" in path else folder
    stage = posixpath.basename(posixpath.dirname(folder))
    with fs.open(f"{folder}/{MANIFEST}", "rb") as f:
        manifest = parse_manifest(f.read(), f"{url}/{MANIFEST}", stage, url)
    record = manifest["files"].get(posixpath.relpath(local, folder))
    return None if record is None else (record, manifest.get("stage", stage), url)
