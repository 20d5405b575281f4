"""The artifact store: where stage outputs live, committed atomically, found again by their key.

Layout under the store's root (a local directory or any fsspec URL such as ``s3://bucket/prefix``)::

    <root>/<stage>/<key>/manifest.json      written last: no manifest means not done
    <root>/<stage>/<key>/<files...>         the artifact's files
    <root>/<stage>/<key>/_shards/<name>.json  one marker per committed shard, written after its files

On a local file system every file is written under a temporary name and renamed into place. On object
stores a PUT is already atomic per object, so data objects go first and the small marker or manifest last.
A killed stage therefore leaves only complete files behind; rerun, it skips the shards whose markers exist.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import fsspec

from storage.fingerprint import canonical_json, hash_bytes, hash_file

log = logging.getLogger("megatron_flow.stage")

MANIFEST = "manifest.json"
SHARD_DIR = "_shards"
_SCRATCH = ".scratch"
# Libraries whose versions go into every manifest when they are installed.
_LIBRARIES = ("numpy", "pyarrow", "fsspec", "tokenizers", "datasets", "torch", "ftfy", "prefect")


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    if _is_local(fs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def _library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


@dataclasses.dataclass(frozen=True)
class ArtifactRef:
    """A committed artifact: small and JSON-serialisable, what flows pass between tasks instead of data."""

    stage: str
    key: str
    url: str
    cache_hit: bool = False
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return fsspec.core.url_to_fs(self.url, **self.storage_options)[0]

    @property
    def fingerprint(self) -> str:
        """What a downstream stage's key depends on: same key, same bytes."""
        return f"{self.stage}:{self.key}"

    def file_url(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def _path(self, name: str) -> str:
        return fsspec.core.url_to_fs(self.file_url(name), **self.storage_options)[1]

    def manifest(self) -> dict[str, Any]:
        with self.fs.open(self._path(MANIFEST), "rb") as f:
            return json.load(f)

    def files(self, prefix: str = "") -> list[str]:
        """Names of the committed files (from the manifest) that start with `prefix`, sorted."""
        return sorted(name for name in self.manifest()["files"] if name.startswith(prefix))

    def local_path(self, name: str) -> str:
        """A local path to one of the artifact's files: the file itself on a local store, else a cached copy."""
        fs = self.fs
        if _is_local(fs):
            return self._path(name)
        cache = os.path.join(
            os.environ.get("MEGATRON_FLOW_CACHE", os.path.expanduser("~/.cache/megatron-flow")),
            self.stage,
            self.key,
            name,
        )
        if not os.path.exists(cache):
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = f"{cache}.tmp-{uuid.uuid4().hex}"
            fs.get_file(self._path(name), tmp)
            os.replace(tmp, cache)
        return cache

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ArtifactWriter:
    """Builds one artifact: commits shards atomically, then the manifest last."""

    def __init__(self, store: ArtifactStore, stage: str, key: str):
        self.store = store
        self.stage = stage
        self.key = key
        self.fs = store.fs
        self.path = store._artifact_path(stage, key)
        self.url = store.artifact_url(stage, key)
        if _is_local(self.fs):
            # Scratch inside the artifact, on the same file system: commits are renames.
            self.local_dir = os.path.join(self.path, _SCRATCH)
            os.makedirs(self.local_dir, exist_ok=True)
        else:
            self.local_dir = tempfile.mkdtemp(prefix=f"{stage}-{key[:12]}-")

    def _marker(self, name: str) -> str:
        return f"{self.path}/{SHARD_DIR}/{name}.json"

    def has_shard(self, name: str) -> bool:
        return self.fs.exists(self._marker(name))

    def shard_files(self, name: str) -> dict[str, dict[str, Any]]:
        """A committed shard's files: {artifact-relative name: {"size", "hash"}}."""
        with self.fs.open(self._marker(name), "rb") as f:
            return json.load(f)["files"]

    def _place(self, local_path: str, name: str) -> dict[str, Any]:
        """Move (local store) or upload (remote store) one file into the artifact; return its size and hash."""
        described = {
            "size": os.path.getsize(local_path),
            "hash": hash_file(local_path, fsspec.filesystem("file")),
        }
        dest = f"{self.path}/{name}"
        if _is_local(self.fs):
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            tmp = f"{dest}.tmp-{uuid.uuid4().hex}"
            if _same_device(local_path, dest):
                os.replace(local_path, tmp)
            else:
                shutil.copyfile(local_path, tmp)
            os.replace(tmp, dest)
        else:
            self.fs.put_file(local_path, dest)
        return described

    def commit_shard(self, name: str, files: dict[str, str]) -> None:
        """Commit a finished unit of work: its files first, then the marker that says it is done."""
        placed = {rel: self._place(local, rel) for rel, local in files.items()}
        marker = canonical_json({"shard": name, "files": placed, "committed_at": time.time()}).encode()
        _write_bytes_atomic(self.fs, self._marker(name), marker)

    def put_file(self, local_path: str, name: str) -> None:
        """Place a non-shard output file (written again on a rerun: it must be reproducible)."""
        self._place(local_path, name)

    def commit(self, manifest: dict[str, Any]) -> ArtifactRef:
        """Describe every file (size, content hash) and write manifest.json last: the artifact is done."""
        known: dict[str, dict[str, Any]] = {}
        if self.fs.exists(f"{self.path}/{SHARD_DIR}"):
            for marker in self.fs.find(f"{self.path}/{SHARD_DIR}"):
                if marker.endswith(".json"):
                    with self.fs.open(marker, "rb") as f:
                        known.update(json.load(f)["files"])
        files: dict[str, dict[str, Any]] = {}
        root = self.fs._strip_protocol(self.path).rstrip("/")
        for full in sorted(self.fs.find(self.path)):
            rel = self.fs._strip_protocol(full)[len(root) + 1 :]
            if rel == MANIFEST or rel.startswith((f"{SHARD_DIR}/", f"{_SCRATCH}/")) or ".tmp-" in rel:
                continue
            size = self.fs.size(full)
            if rel in known and known[rel]["size"] == size:
                files[rel] = known[rel]
            else:
                files[rel] = {"size": size, "hash": hash_file(full, self.fs)}
        body = {
            "stage": self.stage,
            "key": self.key,
            **manifest,
            "files": files,
            "library_versions": _library_versions(),
            "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        _write_bytes_atomic(
            self.fs, f"{self.path}/{MANIFEST}", json.dumps(body, indent=2, sort_keys=True).encode()
        )
        shutil.rmtree(self.local_dir, ignore_errors=True)
        return ArtifactRef(self.stage, self.key, self.url, storage_options=self.store.storage_options)


def _same_device(src: str, dest: str) -> bool:
    try:
        return os.stat(src).st_dev == os.stat(os.path.dirname(dest)).st_dev
    except OSError:
        return False


class ArtifactStore:
    """Stage outputs under a root URL: ``./artifacts`` by default, or ``s3://``, ``gs://``, ``memory://`` ..."""

    def __init__(self, url: str = "./artifacts", **storage_options: Any):
        if "://" not in url:
            url = os.path.abspath(url)
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **storage_options)
        self.root = self.root.rstrip("/")
        if _is_local(self.fs):
            os.makedirs(self.root, exist_ok=True)

    def _artifact_path(self, stage: str, key: str) -> str:
        return f"{self.root}/{stage}/{key}"

    def artifact_url(self, stage: str, key: str) -> str:
        return f"{self.url}/{stage}/{key}"

    def find(self, stage: str, key: str) -> ArtifactRef | None:
        """The committed artifact with this key, or None (a partial artifact is never reported as done)."""
        if self.fs.exists(f"{self._artifact_path(stage, key)}/{MANIFEST}"):
            return ArtifactRef(
                stage, key, self.artifact_url(stage, key), storage_options=self.storage_options
            )
        return None

    def begin(self, stage: str, key: str) -> ArtifactWriter:
        """A writer for the artifact; shards committed by an earlier, interrupted attempt are kept."""
        return ArtifactWriter(self, stage, key)

    def ref(self, data: dict[str, Any]) -> ArtifactRef:
        """Rebuild a reference passed around as a plain dict (e.g. a Prefect result)."""
        return ArtifactRef(**{**data, "storage_options": data.get("storage_options") or self.storage_options})


def input_fingerprint(item: ArtifactRef | str) -> str:
    return item.fingerprint if isinstance(item, ArtifactRef) else item


def stage_key(stage: str, version: str, params: Any, inputs: Sequence[ArtifactRef | str]) -> str:
    """The output key: stage name, version, canonical params and the inputs' fingerprints."""
    fingerprints = [input_fingerprint(i) for i in inputs]
    description = {"stage": stage, "version": version, "params": params, "inputs": fingerprints}
    return hash_bytes(canonical_json(description).encode())


def run_stage(
    store: ArtifactStore,
    stage: str,
    version: str,
    params: Any,
    inputs: Sequence[ArtifactRef | str],
    build: Callable[[ArtifactWriter], dict[str, Any]],
) -> ArtifactRef:
    """The stage contract in one function: a cache hit returns at once, else build, then commit the manifest.

    `inputs` are upstream artifacts or fingerprints of external sources; `build` does the work through the
    writer (skipping shards already committed) and returns the manifest's extra fields (counts, ...).
    """
    fingerprints = [input_fingerprint(i) for i in inputs]
    key = stage_key(stage, version, params, inputs)
    found = store.find(stage, key)
    if found is not None:
        log.info("%s: cache hit %s", stage, found.url)
        return dataclasses.replace(found, cache_hit=True)
    started = time.time()
    writer = store.begin(stage, key)
    extra = build(writer)
    seconds = time.time() - started
    manifest = {
        "version": version,
        "params": json.loads(canonical_json(params)),
        "inputs": fingerprints,
        **extra,
        "seconds": round(seconds, 3),
    }
    ref = writer.commit(manifest)
    log.info("%s: built %s in %.1f s", stage, ref.url, seconds)
    return ref
