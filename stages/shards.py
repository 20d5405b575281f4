"""Shared plumbing of the document stages: Parquet shard names, per-shard parallel mapping, shard counts.

A stage splits its work into one task per input shard. Each task is a top-level function (picklable) that
builds its files, commits them as one shard of the output artifact and returns small counts; the parent
maps it with `map_shards`, which a Prefect flow replaces with its own task runner (processes, Dask, Ray).
`map_shards(fn, args_list, on_result)` calls `on_result` with each result as soon as it is done (progress and
throughput lines) and returns the results in order. A task that needs something costly per process (a
tokenizer) builds it on its first call and caches it, which works the same on every runner.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from storage.artifacts import ArtifactRef, ArtifactWriter

log = logging.getLogger("megatron_flow.stage")

SHARD_DIR = "shards"
STATS_DIR = "stats"

OnResult = Callable[[Any], None]


class MapShards(Protocol):
    def __call__(
        self, fn: Callable[..., Any], args: Sequence[tuple], on_result: OnResult | None = None
    ) -> list: ...


def shard_name(index: int) -> str:
    return f"{index:05d}"


def shard_file(name: str) -> str:
    """The artifact-relative name of a document shard: shards/00000.parquet."""
    return f"{SHARD_DIR}/{name}.parquet"


def stats_file(name: str) -> str:
    return f"{STATS_DIR}/{name}.json"


def document_shards(ref: ArtifactRef) -> list[str]:
    """Names ('00000', ...) of an artifact's document shards, sorted."""
    names = [f[len(SHARD_DIR) + 1 : -len(".parquet")] for f in ref.files(f"{SHARD_DIR}/")]
    if not names:
        raise ValueError(f"{ref.url}: artifact of stage {ref.stage!r} has no {SHARD_DIR}/*.parquet documents")
    return names


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def process_pool(workers: int | None = None) -> MapShards:
    """The default `map_shards`: a local process pool (in-process when one worker or one task)."""
    workers = workers or default_workers()

    def map_shards(fn: Callable[..., Any], args: Sequence[tuple], on_result: OnResult | None = None) -> list:
        results: list = [None] * len(args)

        def done(index: int, result: Any) -> None:
            results[index] = result
            if on_result is not None:
                on_result(result)

        if workers == 1 or len(args) <= 1:
            for index, a in enumerate(tqdm(args, desc=fn.__name__, unit="shard", disable=len(args) <= 1)):
                done(index, fn(*a))
            return results
        with ProcessPoolExecutor(min(workers, len(args))) as pool:
            futures = {pool.submit(fn, *a): i for i, a in enumerate(args)}
            for future in tqdm(as_completed(futures), total=len(args), desc=fn.__name__, unit="shard"):
                done(futures[future], future.result())
        return results

    return map_shards


def write_json(obj: Any, local_path: str) -> str:
    os.makedirs(os.path.dirname(local_path), exist_ok=True)
    with open(local_path, "w") as f:
        json.dump(obj, f, sort_keys=True)
    return local_path


def read_committed_json(writer: ArtifactWriter, name: str) -> Any:
    """A JSON file already committed into the artifact being built (a finished shard's counts)."""
    with writer.fs.open(f"{writer.path}/{name}", "rb") as f:
        return json.load(f)


def read_committed_npy(writer: ArtifactWriter, name: str) -> np.ndarray:
    """A numpy array already committed into the artifact being built."""
    with writer.fs.open(f"{writer.path}/{name}", "rb") as f:
        return np.load(f)


def read_committed_npy_ranges(
    writer: ArtifactWriter, name: str, starts: Sequence[int], stops: Sequence[int]
) -> np.ndarray:
    """Elements [start, stop) of a committed .npy array (flattened, C order) for each range, concatenated.

    Only those bytes are read (ranged GETs on object stores), so a task can take its slice of a large file
    without loading it.
    """
    with writer.fs.open(f"{writer.path}/{name}", "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        _, fortran_order, dtype = read_header(f)
        if fortran_order:
            raise ValueError(
                f"{writer.url}/{name}: Fortran-ordered array; write it with np.save of a C array"
            )
        data_start = f.tell()
        chunks = []
        for start, stop in zip(starts, stops, strict=True):
            f.seek(data_start + int(start) * dtype.itemsize)
            chunks.append(np.frombuffer(f.read((int(stop) - int(start)) * dtype.itemsize), dtype=dtype))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def run_shards(
    writer: ArtifactWriter,
    task: Callable[..., dict],
    args: list[tuple],
    names: list[str],
    map_shards: MapShards,
    on_result: OnResult | None = None,
) -> None:
    """Run `task(*args[i])`, which commits shard `names[i]`, for the shards not committed yet; `on_result`
    gets the result of each task run now, as it finishes."""
    todo = [a for a, name in zip(args, names, strict=True) if not writer.has_shard(name)]
    if len(todo) < len(names):
        log.info("resuming: %d of %d shards already committed", len(names) - len(todo), len(names))
    if not todo:
        return
    started = time.time()
    map_shards(task, todo, on_result)
    seconds = time.time() - started
    log.info(
        "%s: %d of %d shards in %.1f s (%.2f shards/s)",
        task.__name__,
        len(todo),
        len(names),
        seconds,
        len(todo) / max(seconds, 1e-9),
    )


def shard_stats(writer: ArtifactWriter, names: list[str]) -> list[dict]:
    """The counts each committed shard wrote to `stats/<name>.json`."""
    return [read_committed_json(writer, stats_file(name)) for name in names]


def sum_counts(counts: list[dict]) -> dict:
    """Add up shard counts key by key; nested dicts (e.g. drops per rule) are added up too."""
    total: dict = {}
    for shard in counts:
        for key, value in shard.items():
            if isinstance(value, dict):
                total[key] = sum_counts([total.get(key, {}), value])
            else:
                total[key] = total.get(key, 0) + value
    return total
