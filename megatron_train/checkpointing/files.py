"""The files of a checkpoint: their paths, atomic writes that record a content hash, and reads that verify it.

Every file a save writes is hashed (xxh3-128, as the artifact manifests) by the rank that wrote it, and
metadata.json, written last, lists each one's size and hash relative to its iteration folder. A read checks
the size first (a truncated file is named at once) and the hash before any of its bytes are used, so a file
damaged after the save fails with an error naming it instead of loading NaN weights (docs/architecture.md,
checkpoints). Checkpoints saved before hashes were recorded load unverified, with a warning.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from typing import Any

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_tensor_bytes
from safetensors.torch import save_file

from storage.atomic import atomic_path, atomic_write_bytes, atomic_write_text
from storage.fingerprint import hash_bytes, hash_file

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: global layer names and PP stage records, any (TP, PP) layout loads
# Version 1 wrote only PP = 1 checkpoints, whose names and records version 2 reads unchanged.
READABLE_FORMAT_VERSIONS = (1, 2)
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
METADATA_FILENAME = "metadata.json"
MAX_METADATA_BYTES = 256 << 20  # metadata.json: args and a record per file, kilobytes to a few megabytes
# A torch_dist save's metadata.json is Megatron-Core's backend record alone (megatron-core reads it as its
# CheckpointingConfig); our metadata of the save goes here, written just before it.
DIST_METADATA_FILENAME = "flow_metadata.json"
NON_PERSISTENT_DIR = "non_persistent"  # Megatron's folder of global non-persistent checkpoints under --save

FileRecord = dict[str, Any]  # {"size": bytes, "hash": xxh3-128 hex digest}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded or saved: the message names the file and what to do."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def model_shard_dir(
    iteration_dir: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int | None = None
) -> str:
    """Megatron's per-model-parallel-rank folder name: mp_rank_<tp>[_<pp>]; with `ep_rank`, the folder of the MoE
    experts expert-parallel rank `ep_rank` holds (its expert TP rank as <tp>): mp_rank_<tp>[_<pp>]_expert_<ep>."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    if ep_rank is not None:
        name += f"_expert_{ep_rank:03d}"
    return os.path.join(iteration_dir, name)


def is_complete(iteration_dir: str) -> bool:
    """A save finished writing the folder: its metadata.json, written last, is there."""
    return os.path.exists(os.path.join(iteration_dir, METADATA_FILENAME))


def complete_iterations(root: str) -> list[int]:
    """The iterations of `root` whose folders are complete, ascending (none for a missing folder)."""
    if not os.path.isdir(root):
        return []
    return sorted(
        int(name.removeprefix("iter_"))
        for name in os.listdir(root)
        if name.startswith("iter_")
        and name.removeprefix("iter_").isdigit()
        and is_complete(os.path.join(root, name))
    )


def save_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """safetensors' save_file; a failed write (the library's SafetensorError, "os error 28") is the OSError it
    stands for, naming `path`, so a saver reports a full disk or a read-only folder like any other write.

    At most one metadata key: safetensors keeps them in a hash map written in a per-process random order, so two
    keys made the same tensors' file differ from run to run (and a rerun's bytes from the first run's)."""
    if len(metadata) > 1:
        raise ValueError(f"{path}: one safetensors metadata key at most, not {sorted(metadata)}")
    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as error:
        code = re.search(r"os error (\d+)", str(error))
        if code is None:
            raise OSError(errno.EIO, f"safetensors could not write the file ({error})", path) from error
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from error


def write_tensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> FileRecord:
    """A safetensors file, atomically (one fsync); returns its size and content hash, the hash taken from the
    tensors in memory instead of reading the file back."""
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    with atomic_path(path) as tmp:
        save_safetensors(tensors, tmp, metadata)
        size = os.path.getsize(tmp)
        return {"size": size, "hash": _safetensors_hash(tmp, size, tensors)}


def _safetensors_hash(path: str, size: int, tensors: dict[str, torch.Tensor]) -> str:
    """xxh3-128 of the safetensors file `path` just written from `tensors`: the file is its header (read back,
    a few KB) followed by each tensor's bytes at the offsets the header records, so hashing those in order
    equals `hash_file(path)` without reading the data again."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        header_bytes = handle.read(int.from_bytes(prefix, "little"))
    digest = xxhash.xxh3_128(prefix + header_bytes)
    header = json.loads(header_bytes)
    header.pop("__metadata__", None)
    offset = 0
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        start, end = entry["data_offsets"]
        if start != offset:
            raise CheckpointError(f"{path}: tensor {name} starts at byte {start} of the data, not {offset}")
        digest.update(tensors[name].reshape(-1).view(torch.uint8).numpy())
        offset = end
    if 8 + len(header_bytes) + offset != size:
        raise CheckpointError(
            f"{path}: {size} bytes, but its header describes {8 + len(header_bytes) + offset}"
        )
    return digest.hexdigest()


def write_json(path: str, value: Any) -> FileRecord:
    """A JSON file, atomically; returns its size and content hash."""
    data = json.dumps(value).encode()
    atomic_write_bytes(path, data)
    return {"size": len(data), "hash": hash_bytes(data)}


def write_metadata(iteration_dir: str, metadata: dict[str, Any]) -> None:
    """metadata.json (with the file records under "files"): the folder is complete once it exists."""
    atomic_write_text(os.path.join(iteration_dir, METADATA_FILENAME), json.dumps(metadata, indent=1))


def write_marker(root: str, iteration: int) -> None:
    atomic_write_text(os.path.join(root, TRACKER_FILENAME), str(iteration))


def read_latest_iteration(load_dir: str) -> int | None:
    """The iteration in the latest marker, None when there is none (nothing saved yet)."""
    path = os.path.join(load_dir, TRACKER_FILENAME)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as handle:  # a number: a few bytes (a larger file is not a marker)
        text = handle.read(64).decode("utf-8", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number but holds {text[:40]!r}")
    return int(text)


def resolve_iteration_dir(load_dir: str, iteration: int | None) -> str | None:
    """The folder of `iteration` (default: the latest marker's) in `load_dir`; None when there is no marker."""
    if iteration is None:
        iteration = read_latest_iteration(load_dir)
        if iteration is None:
            return None
    iteration_dir = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(iteration_dir):
        saved = (
            sorted(d for d in os.listdir(load_dir) if d.startswith("iter_"))
            if os.path.isdir(load_dir)
            else []
        )
        raise CheckpointError(f"checkpoint folder {iteration_dir} does not exist (iterations there: {saved})")
    return iteration_dir


def require_iteration_dir(load_dir: str, iteration: int | None) -> str:
    """`resolve_iteration_dir`, with an error naming what is missing where it finds no checkpoint."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"{load_dir} does not exist: pass the folder a run saved its checkpoints to")
    iteration_dir = resolve_iteration_dir(load_dir, iteration)
    if iteration_dir is None:
        raise CheckpointError(
            f"{load_dir} holds no {TRACKER_FILENAME} (complete iterations there: {complete_iterations(load_dir)}): "
            "pass --iteration"
        )
    return iteration_dir


def missing_file_error(path: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path} is missing: the save did not finish or files were moved")


def _parse_json(path: str, data: bytes) -> Any:
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON ({error})") from error


def _read_json(path: str) -> Any:
    if not os.path.exists(path):
        raise missing_file_error(path)
    if not os.path.isfile(path):  # a FIFO or a device would block the read or never end it
        raise CheckpointError(f"{path} is not a regular file; the checkpoint folder is damaged")
    size = os.path.getsize(path)
    if size > MAX_METADATA_BYTES:
        raise CheckpointError(
            f"{path}: {size} bytes, over the {MAX_METADATA_BYTES} bytes of a checkpoint's metadata"
        )
    with open(path, "rb") as handle:
        return _parse_json(path, handle.read())


def read_metadata(iteration_dir: str) -> dict:
    """metadata.json of one of our saves; of a torch_dist save, its backend record with our metadata of the save
    (`DIST_METADATA_FILENAME`)."""
    path = os.path.join(iteration_dir, METADATA_FILENAME)
    metadata = _read_json(path)
    if isinstance(metadata, dict) and "sharded_backend" in metadata and "format_version" not in metadata:
        dist_path = os.path.join(iteration_dir, DIST_METADATA_FILENAME)
        if os.path.exists(dist_path):
            dist_metadata = _read_json(dist_path)
            if not isinstance(dist_metadata, dict):
                raise CheckpointError(f"{dist_path}: not a checkpoint's metadata (an object)")
            metadata, path = {**metadata, **dist_metadata}, dist_path
    files = metadata.get("files") if isinstance(metadata, dict) else None
    if not isinstance(metadata, dict) or not (
        files is None
        or isinstance(files, dict)
        and all(isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("hash"), str)
                for r in files.values())
    ):  # fmt: skip
        raise CheckpointError(
            f"{path}: not a checkpoint's metadata (an object whose files are {{size, hash}})"
        )
    if metadata.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise CheckpointError(
            f"{iteration_dir}/{METADATA_FILENAME}: format version {metadata.get('format_version')} is not one "
            f"this code reads ({READABLE_FORMAT_VERSIONS}); convert it with the code version that wrote it"
        )
    return metadata


class CheckpointFiles:
    """Reads the files of one saved iteration, each checked against the size and hash metadata.json records."""

    def __init__(self, iteration_dir: str, metadata: dict) -> None:
        self.iteration_dir = iteration_dir
        self.records: dict[str, FileRecord] | None = metadata.get("files")
        self._verified: set[str] = set()
        if self.records is None:
            logger.warning(
                "%s/%s records no content hashes (saved before they were added): its files load unverified",
                iteration_dir,
                METADATA_FILENAME,
            )

    def _record(self, path: str) -> FileRecord | None:
        """The saved size and hash of `path` (None for a checkpoint without hashes)."""
        if not os.path.exists(path):
            raise missing_file_error(path)
        if self.records is None:
            return None
        name = os.path.relpath(path, self.iteration_dir).replace(os.sep, "/")
        if name not in self.records:
            raise CheckpointError(
                f"checkpoint file {path} is not among the files {self.iteration_dir}/{METADATA_FILENAME} "
                "lists: the files of this folder do not belong together; load another iteration"
            )
        record = self.records[name]
        size = os.path.getsize(path)
        if size != record["size"]:
            raise self._corrupt(path, f"it has {size} bytes but the save wrote {record['size']}")
        return record

    def _corrupt(self, path: str, what: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint file {path} is corrupt: {what} (damaged or partly copied after the save); restore "
            "it, or load an earlier iteration with --ckpt-step"
        )

    def _check_hash(self, path: str, record: FileRecord, digest: str) -> None:
        if digest != record["hash"]:
            raise self._corrupt(
                path, f"its content hash {digest} is not the {record['hash']} recorded in {METADATA_FILENAME}"
            )

    def verify(self, path: str) -> None:
        """Hash `path` once (a streamed read that also brings it into the page cache for the reads after)."""
        if path in self._verified:
            return
        record = self._record(path)
        if record is not None:
            self._check_hash(path, record, hash_file(path))
        self._verified.add(path)

    def _read_bytes(self, path: str) -> bytes:
        """A small file's bytes, read once and verified."""
        record = self._record(path)
        with open(path, "rb") as handle:
            data = handle.read()
        if record is not None:
            self._check_hash(path, record, hash_bytes(data))
        return data

    def read_json(self, path: str) -> Any:
        return _parse_json(path, self._read_bytes(path))

    def read_tensors(self, path: str) -> dict[str, torch.Tensor]:
        """Every tensor of a small safetensors file (one read, verified)."""
        data = self._read_bytes(path)
        try:
            return load_tensor_bytes(data)
        except (SafetensorError, ValueError) as error:
            raise self._corrupt(path, f"safetensors cannot parse it ({error})") from error

    def open_tensors(self, path: str) -> Any:
        """A lazy safetensors handle (only the header read); call `verify` before reading its tensors."""
        self._record(path)
        try:
            return safe_open(path, framework="pt")
        except (SafetensorError, OSError, ValueError) as error:
            raise self._corrupt(path, f"safetensors cannot parse it ({error})") from error
