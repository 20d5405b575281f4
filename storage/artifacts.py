"""The artifact store: where stage outputs live, committed atomically, found again by their key.

Layout under the store's root (a local directory or any fsspec URL such as ``s3://bucket/prefix``)::

    <root>/<stage>/<key>/manifest.json      written last: no manifest means not done
    <root>/<stage>/<key>/<files...>         the artifact's files
    <root>/<stage>/<key>/_shards/<name>.json  one marker per committed shard, written after its files

On a local file system every file is written under a temporary name and renamed into place
(`storage.atomic`); names `storage.atomic.is_temporary` recognises are never part of an artifact. On object
stores a PUT is already atomic per object, so data objects go first and the small marker or manifest last.
A killed stage therefore leaves only complete files behind; rerun, it skips the shards whose markers exist.

Concurrent writers of one artifact (two flows started together on one store) are safe, as
docs/architecture.md describes:

- Each writer has scratch space of its own: slot ``<n>`` of ``<root>/.scratch/<stage>/<key>/`` on a local
  store (same file system, so commits are renames), of ``$MEGATRON_FLOW_CACHE/.scratch/...`` otherwise. A
  slot belongs to the writer holding the lock file ``<n>.lock`` (`fcntl.flock`); the kernel drops the lock
  when its process dies, so the next writer takes the slot over and resumes from what is in it.
- Stages are deterministic: two writers commit the same bytes to a shard, and whichever rename or PUT lands
  last leaves the same consistent shard (files first, then the marker that describes them).
- The first manifest wins. Locally it is linked into place, which fails if one exists; on object stores it
  is a conditional PUT (``If-None-Match: *``, honoured by AWS S3 and moto; stores that ignore it fall back
  to last-writer-wins, and both manifests then describe the same files). The loser returns the winner's
  reference as a cache hit without rewriting anything, and it stops placing files once it sees a manifest.
- A writer that fails while another writer built the artifact (e.g. it read files the winner cleaned up)
  waits for the other live writers on this machine, then returns the committed artifact as a cache hit.

Committed artifacts are not trusted blindly: a local artifact's files are read-only (0444), and a stage checks
every file of its input artifacts against their manifests before it builds (`ArtifactRef.verify`,
`storage.verify`). The store's `CachePolicy` rebuilds a committed artifact (`--rebuild STAGE` in the flows) or
reuses one built by other code for the same params and inputs (`--reuse-across-code-changes`): every key covers
the stage's code (`storage.code_fingerprint`), its base key leaves the code out, and ``<root>/.base-keys/<stage>/
<base key>`` names the key last committed for it.

One module, over 400 lines, on purpose: the reference, the writer with its scratch slots and the store are one
commit protocol; its guarantees (who wins, what a reader may see) only read right together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import importlib.metadata
import itertools
import json
import logging
import os
import platform
import posixpath
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import fsspec

from storage.atomic import atomic_move, atomic_path, atomic_write_bytes, is_temporary
from storage.fingerprint import canonical_json, hash_bytes, hash_file
from storage.verify import (
    MANIFEST,
    READ_ONLY,
    ChangedArtifactError,
    check_local_file,
    check_remote_file,
    etag_of,
    parse_manifest,
    with_checksum,
)

log = logging.getLogger("megatron_flow.stage")

SHARD_DIR = "_shards"
SCRATCH_DIR = ".scratch"
BASE_KEYS_DIR = ".base-keys"  # <root>/.base-keys/<stage>/<base key>: the key last committed for it
# Libraries whose versions go into every manifest when they are installed.
_LIBRARIES = ("numpy", "pyarrow", "fsspec", "tokenizers", "datasets", "torch", "ftfy", "prefect")


class AlreadyCommitted(Exception):
    """Another writer committed the artifact first: this writer's work is not needed."""


class StoreNotWritable(Exception):
    """The store cannot be written (a read-only folder or file system, missing permissions)."""


_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


@contextlib.contextmanager
def _writing(url: str) -> Iterator[None]:
    """Permission and read-only errors while writing to the store `url`, as one `StoreNotWritable` line."""
    try:
        yield
    except OSError as error:
        if error.errno not in _NOT_WRITABLE:
            raise
        raise StoreNotWritable(
            f"--store {url} cannot be written ({error.strerror}: {error.filename}); give a writable folder or URL "
            "with --store, or make it writable"
        ) from None


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _cache_root() -> str:
    return os.environ.get("MEGATRON_FLOW_CACHE", os.path.expanduser("~/.cache/megatron-flow"))


def _write_bytes_atomic(
    fs: fsspec.AbstractFileSystem, path: str, data: bytes, read_only: bool = True
) -> None:
    if _is_local(fs):
        atomic_write_bytes(path, data)
        if read_only:
            os.chmod(path, READ_ONLY)
    else:
        fs.pipe_file(path, data)


def _create_once(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Write `path` only if it does not exist yet; False when another writer's file is already there."""
    try:
        if _is_local(fs):
            with atomic_path(path, exclusive=True) as tmp:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.chmod(tmp, READ_ONLY)
        else:
            fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    return True


def checked_name(name: str, where: str) -> str:
    """`name` if it is a relative path inside an artifact: a name read from a manifest must never escape it."""
    normal = posixpath.normpath(name.replace("\\", "/")) if name else ""
    if normal in ("", ".") or normal.startswith(("/", "../")) or normal == ".." or os.path.isabs(name):
        raise ValueError(
            f"{where}: file name {name!r} is absolute or leaves the artifact; an artifact's files are relative "
            "paths below its folder. The manifest was not written by this project or was altered: delete the "
            "artifact and rerun its stage"
        )
    return normal


def _library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


@dataclasses.dataclass(frozen=True)
class CachePolicy:
    """How a stage run treats what the store holds (docs/architecture.md, "Rebuilding and reusing artifacts")."""

    # Discard the committed artifact of the key, then build it again.
    rebuild: bool = False
    # An artifact built by other code for the same params and inputs counts as committed.
    reuse_across_code_changes: bool = False


@dataclasses.dataclass(frozen=True)
class ArtifactRef:
    """A committed artifact: small and JSON-serialisable, what flows pass between tasks instead of data.
    `cache_hit`: this run found it; `rebuilt`: this run discarded the committed artifact and built it again."""

    stage: str
    key: str
    url: str
    cache_hit: bool = False
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)
    rebuilt: bool = False

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return fsspec.core.url_to_fs(self.url, **self.storage_options)[0]

    @property
    def fingerprint(self) -> str:
        """What a downstream stage's key depends on: same key, same bytes."""
        return f"{self.stage}:{self.key}"

    def file_url(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{checked_name(name, f'{self.url}/{MANIFEST}')}"

    def _path(self, name: str) -> str:
        return fsspec.core.url_to_fs(self.file_url(name), **self.storage_options)[1]

    def manifest(self) -> dict[str, Any]:
        with self.fs.open(self._path(MANIFEST), "rb") as f:
            return parse_manifest(f.read(), self.file_url(MANIFEST), self.stage, self.url)

    def verify(self) -> None:
        """Every file the manifest lists is there with its size and hash (on an object store: its size and the
        ETag recorded at commit); else a `ChangedArtifactError` naming the file. Once per process per file."""
        fs, files = self.fs, self.manifest()["files"]
        if _is_local(fs):
            for name, record in files.items():
                check_local_file(self._path(name), record, self.stage, self.url)
            return
        root = self._path(MANIFEST).rsplit("/", 1)[0]
        found = {fs._strip_protocol(path): info for path, info in fs.find(root, detail=True).items()}
        for name, record in files.items():
            path = fs._strip_protocol(self._path(name))
            check_remote_file(fs, path, found.get(path), record, self.stage, self.url)

    def files(self, prefix: str = "") -> list[str]:
        """Names of the committed files (from the manifest) that start with `prefix`, sorted."""
        return sorted(name for name in self.manifest()["files"] if name.startswith(prefix))

    def local_path(self, name: str) -> str:
        """A local path to one of the artifact's files: the file itself on a local store, else a cached copy,
        checked against the manifest (a copy that changed on disk is downloaded again, once)."""
        fs = self.fs
        if _is_local(fs):
            return self._path(name)
        relative = checked_name(name, f"{self.url}/{MANIFEST}")
        cache = os.path.join(_cache_root(), self.stage, self.key, *relative.split("/"))
        record = self.manifest()["files"].get(relative)
        for attempt in range(2):
            if not os.path.exists(cache):
                with atomic_path(cache) as tmp:
                    fs.get_file(self._path(relative), tmp)
            if record is None:
                break
            try:
                check_local_file(cache, record, self.stage, self.url)
                break
            except ChangedArtifactError:
                if attempt:  # a fresh download differs too: the object itself changed
                    raise
                os.remove(cache)
        return cache

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _ScratchSlot:
    """A writer's own scratch folder, ``<base>/<n>``, owned while the lock file ``<base>/<n>.lock`` is held.

    Lock files are never deleted (deleting one while another writer opens it would let two writers own a
    slot); they are empty and live outside every artifact.
    """

    def __init__(self, base: str):
        os.makedirs(base, exist_ok=True)
        self.base = base
        for n in itertools.count():
            handle = try_lock(os.path.join(base, f"{n}.lock"))
            if handle is not None:
                self.lock: IO[bytes] | None = handle
                self.path = os.path.join(base, str(n))
                os.makedirs(self.path, exist_ok=True)
                return

    def others(self) -> list[str]:
        """Lock files of the other slots (live or abandoned writers of the same artifact)."""
        mine = f"{self.path}.lock"
        return sorted(
            os.path.join(self.base, name)
            for name in os.listdir(self.base)
            if name.endswith(".lock") and os.path.join(self.base, name) != mine
        )

    def wait_for_others(self) -> None:
        """Block until no other writer on this machine holds a slot of this artifact."""
        for lock in self.others():
            with open(lock, "rb") as handle:
                fcntl.flock(handle, fcntl.LOCK_SH)

    def release(self, remove: bool) -> None:
        """Give the slot up; `remove` deletes its folder and those of abandoned slots (the artifact is done)."""
        if self.lock is None:
            return
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
            for lock in self.others():
                handle = try_lock(lock)
                if handle is not None:
                    shutil.rmtree(lock[: -len(".lock")], ignore_errors=True)
                    handle.close()
        self.lock.close()
        self.lock = None


def try_lock(path: str) -> IO[bytes] | None:
    """The open lock file with an exclusive lock taken, or None when another process holds it.

    The lock lasts until the file is closed or the process dies (the kernel releases it even after SIGKILL).
    """
    handle = open(path, "ab")  # noqa: SIM115 - held open: the lock lives as long as the handle
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


class ArtifactWriter:
    """Builds one artifact: commits shards atomically, then the manifest last (first writer's manifest wins).

    `local_dir` is this writer's own scratch folder; a writer that was killed leaves it to the next writer of
    the same artifact, which can resume from it (the pretrain stage's run directory). Worker processes get a
    pickled copy that can place files and commit shards but does not own the scratch slot.
    """

    def __init__(self, store: ArtifactStore, stage: str, key: str):
        self.store = store
        self.stage = stage
        self.key = key
        self.fs = store.fs
        self.path = store._artifact_path(stage, key)
        self.url = store.artifact_url(stage, key)
        if _is_local(self.fs):  # on the store's file system: commits are renames
            base = os.path.join(store.root, SCRATCH_DIR, stage, key)
        else:
            base = os.path.join(_cache_root(), SCRATCH_DIR, hash_bytes(store.url.encode()), stage, key)
        self._slot: _ScratchSlot | None = _ScratchSlot(base)
        self.local_dir = self._slot.path

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_slot": None}

    def _marker(self, name: str) -> str:
        return f"{self.path}/{SHARD_DIR}/{name}.json"

    def is_committed(self) -> bool:
        return self.fs.exists(f"{self.path}/{MANIFEST}")

    def _check_not_committed(self) -> None:
        if self.is_committed():
            raise AlreadyCommitted(f"{self.url} was committed by another writer")

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
        dest = f"{self.path}/{checked_name(name, self.url)}"
        if _is_local(self.fs):
            atomic_move(local_path, dest)
            # Read-only once committed; a hard link (to another artifact's file, a user's file) keeps its mode.
            if os.stat(dest).st_nlink == 1:
                os.chmod(dest, READ_ONLY)
        else:
            self.fs.put_file(local_path, dest)
        return described

    def commit_shard(self, name: str, files: dict[str, str]) -> None:
        """Commit a finished unit of work: its files first, then the marker that says it is done. When another
        writer has committed the artifact meanwhile, the unit's local files are deleted (nothing needs them)."""
        if self.is_committed():
            for local in files.values():
                with contextlib.suppress(FileNotFoundError):
                    os.remove(local)
            raise AlreadyCommitted(f"{self.url} was committed by another writer")
        placed = {rel: self._place(local, rel) for rel, local in files.items()}
        marker = canonical_json({"shard": name, "files": placed, "committed_at": time.time()}).encode()
        _write_bytes_atomic(self.fs, self._marker(name), marker)

    def has_file(self, name: str) -> bool:
        """Whether `name` is already placed in the artifact (by this writer or an earlier one of the same key)."""
        return self.fs.exists(f"{self.path}/{checked_name(name, self.url)}")

    def put_file(self, local_path: str, name: str) -> None:
        """Place a non-shard output file (written again on a rerun: it must be reproducible)."""
        self._check_not_committed()
        self._place(local_path, name)

    def _describe_files(self) -> dict[str, dict[str, Any]]:
        """Every committed file of the artifact with its size and hash (from shard markers where they match)."""
        known: dict[str, dict[str, Any]] = {}
        if self.fs.exists(f"{self.path}/{SHARD_DIR}"):
            for marker in self.fs.find(f"{self.path}/{SHARD_DIR}"):
                if marker.endswith(".json"):
                    with self.fs.open(marker, "rb") as f:
                        known.update(json.load(f)["files"])
        files: dict[str, dict[str, Any]] = {}
        root = self.fs._strip_protocol(self.path).rstrip("/")
        local = _is_local(self.fs)
        for full, info in sorted(self.fs.find(self.path, detail=True).items()):
            rel = self.fs._strip_protocol(full)[len(root) + 1 :]
            if rel == MANIFEST or rel.startswith(f"{SHARD_DIR}/") or is_temporary(rel):
                continue
            size = info["size"]
            if rel in known and known[rel]["size"] == size:
                files[rel] = {"size": size, "hash": known[rel]["hash"]}
            else:
                files[rel] = {"size": size, "hash": hash_file(full, self.fs)}
            if not local:  # on an object store the ETag stands in for the hash when the artifact is used
                files[rel] |= etag_of(info)
        return files

    def commit(self, manifest: dict[str, Any]) -> ArtifactRef:
        """Describe every file (size, content hash; ETag on object stores) and write manifest.json last, with
        its checksum: the artifact is done. A local artifact's files are read-only (0444).

        When another writer committed first, its artifact is returned as a cache hit and nothing is written.
        """
        ref = ArtifactRef(self.stage, self.key, self.url, storage_options=self.store.storage_options)
        if self.is_committed():
            self.release(remove=True)
            return dataclasses.replace(ref, cache_hit=True)
        body = {
            "stage": self.stage,
            "key": self.key,
            **manifest,
            "files": self._describe_files(),
            "library_versions": _library_versions(),
            "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        won = _create_once(
            self.fs,
            f"{self.path}/{MANIFEST}",
            json.dumps(with_checksum(body), indent=2, sort_keys=True).encode(),
        )
        if won and "base_key" in manifest:
            self.store.point_base_key(self.stage, manifest["base_key"], self.key)
        self.release(remove=True)
        return dataclasses.replace(ref, cache_hit=not won)

    def wait_for_other_writers(self) -> None:
        """Give up this writer's slot, then block while other writers of this artifact run on this machine."""
        if self._slot is not None:
            self._slot.release(remove=False)
            self._slot.wait_for_others()

    def discard_scratch(self) -> None:
        """Delete this writer's scratch once another writer has committed the artifact: nothing in it is needed."""
        shutil.rmtree(self.local_dir, ignore_errors=True)

    def release(self, remove: bool = False) -> None:
        """Give up the scratch slot (idempotent); `remove` also deletes the scratch (the artifact is done)."""
        if self._slot is not None:
            self._slot.release(remove)


class ArtifactStore:
    """Stage outputs under a root URL: ``./artifacts`` by default, or ``s3://``, ``gs://``, ``memory://`` ..."""

    def __init__(
        self, url: str = "./artifacts", cache_policy: CachePolicy = CachePolicy(), **storage_options: Any
    ):
        if "://" not in url:
            url = os.path.abspath(url)
        self.url = url.rstrip("/")
        self.cache_policy = cache_policy
        self.storage_options = storage_options
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **storage_options)
        self.root = self.root.rstrip("/")
        if _is_local(self.fs):
            with contextlib.suppress(OSError):  # a read-only store still serves its artifacts
                os.makedirs(self.root, exist_ok=True)

    def check_writable(self) -> None:
        """A `StoreNotWritable` naming the store now, when it cannot be written, rather than once work started.
        (Object stores answer the first write: their permissions cannot be asked for without one.)"""
        if _is_local(self.fs):
            with _writing(self.url):
                os.makedirs(self.root, exist_ok=True)
                probe = os.path.join(self.root, f".write-check-{os.getpid()}")
                os.close(os.open(probe, os.O_CREAT | os.O_WRONLY))
                os.remove(probe)

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

    def lookup(self, stage: str, key: str, base_key: str) -> ArtifactRef | None:
        """What a stage run of `key` finds under the store's cache policy: the artifact of the key; with
        `reuse_across_code_changes`, else the one last committed for the same params and inputs (`base_key`) by
        other code; with `rebuild`, nothing."""
        if self.cache_policy.rebuild:
            return None
        found = self.find(stage, key)
        if found is None and self.cache_policy.reuse_across_code_changes:
            pointer = f"{self.root}/{BASE_KEYS_DIR}/{stage}/{base_key}"
            if self.fs.exists(pointer):
                other = self.find(stage, self.fs.cat_file(pointer).decode().strip())
                if other is not None and other.manifest().get("base_key") == base_key:
                    return other
        return found

    def point_base_key(self, stage: str, base_key: str, key: str) -> None:
        """Record `key` as the artifact last committed for `base_key` (what `--reuse-across-code-changes` finds)."""
        _write_bytes_atomic(
            self.fs, f"{self.root}/{BASE_KEYS_DIR}/{stage}/{base_key}", key.encode(), read_only=False
        )

    def discard(self, stage: str, key: str) -> None:
        """Remove the committed artifact of `key` (to rebuild it): it stops being committed at once (its folder is
        renamed into scratch, or its manifest deleted first on an object store), then its files go."""
        path = self._artifact_path(stage, key)
        if not self.fs.exists(path):
            return
        log.info("%s: discarding %s to rebuild it", stage, self.artifact_url(stage, key))
        with _writing(self.url):
            self._remove(path)

    def _remove(self, path: str) -> None:
        if _is_local(self.fs):
            discarded = os.path.join(self.root, SCRATCH_DIR, "discarded")
            os.makedirs(discarded, exist_ok=True)
            os.rename(path, os.path.join(discarded, f"{os.path.basename(path)}-{time.time_ns()}"))
            shutil.rmtree(discarded, ignore_errors=True)  # with what an earlier, killed discard left
        else:
            if self.fs.exists(f"{path}/{MANIFEST}"):
                self.fs.rm(f"{path}/{MANIFEST}")
            self.fs.rm(path, recursive=True)

    def begin(self, stage: str, key: str) -> ArtifactWriter:
        """A writer for the artifact; shards committed by an earlier, interrupted attempt are kept."""
        with _writing(self.url):
            return ArtifactWriter(self, stage, key)

    def ref(self, data: dict[str, Any]) -> ArtifactRef:
        """Rebuild a reference passed around as a plain dict (e.g. a Prefect result)."""
        return ArtifactRef(**{**data, "storage_options": data.get("storage_options") or self.storage_options})

    def with_policy(self, cache_policy: CachePolicy) -> ArtifactStore:
        """The same store under another cache policy."""
        return ArtifactStore(self.url, cache_policy, **self.storage_options)


def input_fingerprint(item: ArtifactRef | str) -> str:
    return item.fingerprint if isinstance(item, ArtifactRef) else item


def stage_key(
    stage: str, version: str, params: Any, inputs: Sequence[ArtifactRef | str], code: str | None = None
) -> str:
    """The output key: stage name, version, canonical params, the inputs' fingerprints and the fingerprint of the
    code that builds it (`storage.code_fingerprint`); without `code`, the artifact's base key, which
    `--reuse-across-code-changes` looks artifacts up by."""
    fingerprints = [input_fingerprint(i) for i in inputs]
    description = {"stage": stage, "version": version, "params": params, "inputs": fingerprints}
    if code is not None:
        description["code"] = code
    return hash_bytes(canonical_json(description).encode())


def run_stage(
    store: ArtifactStore,
    stage: str,
    version: str,
    params: Any,
    inputs: Sequence[ArtifactRef | str],
    build: Callable[[ArtifactWriter], dict[str, Any]],
    code: dict[str, Any] | None = None,
    uses: Sequence[ArtifactRef] | None = None,
) -> ArtifactRef:
    """The stage contract in one function: a cache hit returns at once, else verify the input artifacts, build,
    then commit the manifest.

    `inputs` are upstream artifacts or fingerprints of external sources; `code` describes the code that builds
    the artifact (`storage.code_fingerprint.describe_code`: its fingerprint enters the key); `uses` are the
    artifacts whose files `build` reads (default: the artifacts among `inputs`), each checked against its
    manifest first; `build` does the work through the writer (skipping shards already committed) and returns the
    manifest's extra fields (counts, ...). The store's `cache_policy` may rebuild a committed artifact or reuse
    one built by other code.
    """
    fingerprints = [input_fingerprint(i) for i in inputs]
    base_key = stage_key(stage, version, params, inputs)
    key = base_key if code is None else stage_key(stage, version, params, inputs, code["fingerprint"])
    found = store.lookup(stage, key, base_key)
    if found is not None:
        log.info("%s: cache hit %s", stage, found.url)
        return dataclasses.replace(found, cache_hit=True)
    for used in [i for i in inputs if isinstance(i, ArtifactRef)] if uses is None else uses:
        used.verify()
    rebuild = store.cache_policy.rebuild
    if rebuild:
        store.discard(stage, key)
    started = time.time()
    writer = store.begin(stage, key)
    try:
        extra = build(writer)
        seconds = time.time() - started
        manifest = {
            "version": version,
            "params": json.loads(canonical_json(params)),
            "inputs": fingerprints,
            "base_key": base_key,
            **({} if code is None else {"code": code}),
            **extra,
            "seconds": round(seconds, 3),
        }
        ref = writer.commit(manifest)
    except Exception as error:
        writer.wait_for_other_writers()
        found = store.find(stage, key)
        if found is None:
            raise
        writer.discard_scratch()
        log.info("%s: %s was committed by another writer first (%s: %s)", stage, found.url,
                 type(error).__name__, error)  # fmt: skip
        return dataclasses.replace(found, cache_hit=True)
    finally:
        writer.release()
    if ref.cache_hit:
        log.info("%s: %s was committed by another writer first", stage, ref.url)
    else:
        log.info("%s: %s %s in %.1f s", stage, "rebuilt" if rebuild else "built", ref.url, seconds)
    return dataclasses.replace(ref, rebuilt=rebuild and not ref.cache_hit)
