"""Dedup stage: exact and near-duplicate (MinHash-LSH) removal, keeping the first document of each cluster.

Sharded the way datatrove's MinHash pipeline and the distributed engines do it (docs/architecture.md, "Dedup at
cluster scale"): signatures -> buckets -> cluster -> filter, each step a set of tasks committed as shards of the
artifact, and no task holds per-document state for the whole corpus. A document is named by its global id
`shard index << 32 | row`, which orders documents like the corpus.

1. signatures, one task per input shard: each document's exact key (64-bit hash of the normalised text) and
   MinHash signature, and its bucket keys (one per LSH band, plus the exact key as one more band), sorted
   within each band, with the offset where each hash range starts (`minhash/<name>.*.npy`);
2. buckets, one task per band (or group of bands, on a small corpus) and hash range: that slice of every
   shard's sorted keys, read by byte range; documents sharing a key are candidate pairs (first, other), `first`
   the earliest document of the bucket; near candidates are verified by their estimated Jaccard, from the
   signature rows of just those documents (`pairs/<task>.npy`);
3. cluster, one task: union-find over the candidate pairs only, the earliest document of each cluster kept;
   writes the report as one file per input shard, `duplicates.parquet/<name>.parquet` (a Spark-style folder:
   `pyarrow.parquet.read_table` reads it whole);
4. kept documents, one task per input shard: the shard without the rows its report drops (`shards/<name>.parquet`).

Memory: a signature or kept task holds one shard, a bucket task one hash range (`docs_per_bucket_task`
documents per band), the cluster task the candidate pairs and one shard's ids at a time. A rerun after a crash
reruns only the tasks not committed and writes identical bytes.

One module, over 400 lines, on purpose: its four steps (signatures, buckets, cluster, kept documents) share one
file layout and id scheme, and each step's task sits beside the step that maps it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from stages import minhash
from stages.base import Inputs, Stage, expect_inputs
from stages.shards import (
    MapShards,
    document_shards,
    log,
    process_pool,
    read_committed_json,
    read_committed_npy,
    read_committed_npy_ranges,
    run_shards,
    shard_file,
    shard_stats,
    stats_file,
    sum_counts,
    write_json,
)
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter
from storage.documents import read_parquet_columns, write_parquet_table

# Text per MinHash batch: the temporaries of minhash.shingle_hashes (~50 bytes per byte of text) stay in
# cache and on reused pages; 1 MB batches run about 2x slower.
BATCH_TEXT_BYTES = 1 << 18


@dataclass(frozen=True)
class DedupParams:
    """Exact and near-duplicate removal settings.

    With 20 bands x 5 rows, two documents at Jaccard similarity 0.8 (of word 5-gram sets) become candidates
    with probability 1 - (1 - 0.8**5)**20 = 0.9996 (0.975 at 0.7, 0.47 at 0.5, 0.05 at 0.3). With `verify`,
    a candidate pair is kept when its estimated Jaccard (the fraction of equal signature values) is at least
    `threshold - verify_sigmas * sqrt(threshold * (1 - threshold) / num_perm)`, i.e. 0.68 by default: a pair
    at the threshold passes with probability 0.9987, one at 0.5 with 0.0002. This removes the LSH's false
    candidates without losing true pairs to the estimate's noise (sd 0.04 at 100 permutations).
    """

    exact: bool = True
    near: bool = True
    shingle_size: int = 5  # words per shingle
    num_perm: int = 100
    bands: int = 20
    rows: int = 5
    threshold: float = 0.8
    verify: bool = True
    verify_sigmas: float = 3.0
    seed: int = 1
    # Keys (document, band) a bucket task holds, about: the corpus is cut into as many hash ranges as it takes.
    docs_per_bucket_task: int = 1 << 16

    @property
    def verify_cutoff(self) -> float:
        """The smallest estimated Jaccard a verified candidate pair may have."""
        spread = (self.threshold * (1.0 - self.threshold) / self.num_perm) ** 0.5
        return self.threshold - self.verify_sigmas * spread

    def __post_init__(self) -> None:
        if self.bands * self.rows > self.num_perm:
            raise ValueError(f"bands x rows = {self.bands * self.rows} exceeds num_perm = {self.num_perm}")
        if self.shingle_size < 1 or not 0.0 < self.threshold <= 1.0:
            raise ValueError("shingle_size must be >= 1 and threshold in (0, 1]")
        if self.docs_per_bucket_task < 1:
            raise ValueError(f"docs_per_bucket_task must be at least 1, got {self.docs_per_bucket_task}")

    @property
    def key_kinds(self) -> list[str]:
        """What each band of bucket keys is: the LSH bands ("near"), then the exact key ("exact")."""
        return ["near"] * (self.bands if self.near else 0) + ["exact"] * self.exact


# Pair kinds in pairs/<task>.npy (third column).
EXACT_PAIR, NEAR_PAIR, REJECTED_PAIR = 0, 1, 2
ROW_BITS = 32  # global id = shard index << ROW_BITS | row
CLUSTERS = "clusters"  # the cluster task's shard name
REPORT_DIR = "duplicates.parquet"
REPORT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("shard", pa.string()),
        ("row", pa.int64()),
        ("cluster", pa.string()),
        ("cluster_size", pa.int64()),
        ("kept", pa.bool_()),
        ("kind", pa.string()),
    ]
)


def _minhash_files(name: str) -> dict[str, str]:
    parts = ("exact", "signatures", "keys", "rows", "offsets")
    return {part: f"minhash/{name}.{part}.npy" for part in parts}


def report_file(name: str) -> str:
    return f"{REPORT_DIR}/{name}.parquet"


def shard_rows(source: ArtifactRef, name: str) -> int:
    """Documents in one input shard, from its Parquet footer (read by byte range)."""
    with fsspec.open(source.file_url(shard_file(name)), "rb", **source.storage_options) as f:
        return pq.read_metadata(f).num_rows


def hash_range_starts(ranges: int) -> np.ndarray:
    """The smallest 64-bit key of hash ranges 1 .. ranges-1 (range 0 starts at 0): equal parts of the keys."""
    return np.array([(r << 64) // ranges for r in range(1, ranges)], dtype=np.uint64)


def bucket_tasks(params: DedupParams, docs: int) -> tuple[int, list[tuple[list[int], int]]]:
    """The number of hash ranges and the bucket tasks, (bands, hash range) each, so that a task holds about
    `docs_per_bucket_task` keys (one band per task, or several when the whole corpus is smaller than that)."""
    ranges = max(1, math.ceil(docs / params.docs_per_bucket_task))
    bands = list(range(len(params.key_kinds)))
    per_task = max(1, params.docs_per_bucket_task // max(docs, 1)) if ranges == 1 else 1
    groups = [bands[i : i + per_task] for i in range(0, len(bands), per_task)]
    return ranges, [(group, r) for group in groups for r in range(ranges)]


def bucket_task_name(bands: list[int], hash_range: int) -> str:
    return f"buckets-{bands[0]:03d}-{bands[-1]:03d}-{hash_range:05d}"


def minhash_shard(
    writer: ArtifactWriter, source: ArtifactRef, name: str, params: DedupParams, ranges: int
) -> dict:
    """Exact keys, MinHash signatures and bucket keys (sorted per band, split into `ranges` hash ranges) of
    one input shard."""
    texts = read_parquet_columns(source.local_path(shard_file(name)), ["text"]).column("text").to_pylist()
    normalized = [minhash.normalize_for_dedup(t) for t in texts]
    exact = np.array([xxhash.xxh3_64_intdigest(t.encode()) for t in normalized], dtype=np.uint64)
    arrays = {"exact": exact}
    keys = []
    if params.near:
        a, b = minhash.permutations(params.num_perm, params.seed)
        batches, start, size = [], 0, 0
        for i, text in enumerate(normalized):
            size += len(text) + 1
            if size >= BATCH_TEXT_BYTES or i == len(normalized) - 1:
                hashes, counts = minhash.shingle_hashes(normalized[start : i + 1], params.shingle_size)
                batches.append(minhash.signatures(hashes, counts, a, b))
                start, size = i + 1, 0
        signatures = np.concatenate(batches) if batches else np.zeros((0, params.num_perm), dtype=np.uint32)
        arrays["signatures"] = signatures
        keys = [minhash.band_keys(signatures, params.bands, params.rows)]
    if params.exact:
        keys.append(exact[:, None])
    by_band = np.concatenate(keys, axis=1).T if keys else np.zeros((0, len(texts)), dtype=np.uint64)
    order = np.argsort(by_band, axis=1, kind="stable")
    arrays["keys"] = np.take_along_axis(by_band, order, axis=1)
    arrays["rows"] = order.astype(np.uint32)
    # Where each band's hash ranges start, and its end: flat positions in keys/rows (band b starts at b * n).
    n = len(texts)
    bounds = [
        np.concatenate(([0], np.searchsorted(k, hash_range_starts(ranges)), [n])) + band * n
        for band, k in enumerate(arrays["keys"])
    ]
    arrays["offsets"] = np.array(bounds, dtype=np.int64).reshape(len(by_band), ranges + 1)
    files = {}
    for part, array in arrays.items():
        relative = _minhash_files(name)[part]
        files[relative] = os.path.join(writer.local_dir, relative)
        os.makedirs(os.path.dirname(files[relative]), exist_ok=True)
        np.save(files[relative], array)
    writer.commit_shard(f"minhash-{name}", files)
    return {"docs": len(texts)}


def _band_slice(
    writer: ArtifactWriter, names: list[str], band: int, hash_range: int, ranges: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every shard's keys of one band in one hash range, and their documents' global ids, in id order."""
    keys, ids = [], []
    for index, name in enumerate(names):
        files = _minhash_files(name)
        position = band * (ranges + 1) + hash_range
        start, stop = read_committed_npy_ranges(writer, files["offsets"], [position], [position + 2])
        keys.append(read_committed_npy_ranges(writer, files["keys"], [start], [stop]))
        rows = read_committed_npy_ranges(writer, files["rows"], [start], [stop]).astype(np.int64)
        ids.append((index << ROW_BITS) | rows)
    keys_, ids_ = np.concatenate(keys), np.concatenate(ids)
    order = np.argsort(ids_, kind="stable")
    return keys_[order], ids_[order]


def _signature_rows(writer: ArtifactWriter, names: list[str], ids: np.ndarray, num_perm: int) -> np.ndarray:
    """The MinHash signatures of the documents `ids` (sorted, unique), reading only their rows."""
    rows = []
    for index in np.unique(ids >> ROW_BITS):
        row = ids[ids >> ROW_BITS == index] & ((1 << ROW_BITS) - 1)
        name = _minhash_files(names[index])["signatures"]
        rows.append(read_committed_npy_ranges(writer, name, row * num_perm, (row + 1) * num_perm))
    return np.concatenate(rows).reshape(len(ids), num_perm) if rows else np.zeros((0, num_perm), np.uint32)


def bucket_shard(
    writer: ArtifactWriter,
    names: list[str],
    params: DedupParams,
    bands: list[int],
    hash_range: int,
    ranges: int,
) -> dict:
    """Candidate pairs of the documents sharing a key in `bands` within one hash range; near pairs verified."""
    kinds = params.key_kinds
    exact_pairs, near_pairs = [], []
    for band in bands:
        keys, ids = _band_slice(writer, names, band, hash_range, ranges)
        first, other = minhash.bucket_pairs(keys[:, None])
        pairs = np.stack([ids[first], ids[other]], axis=1)
        (exact_pairs if kinds[band] == "exact" else near_pairs).append(pairs)
    pairs = [np.zeros((0, 3), dtype=np.int64)]
    if exact_pairs:
        exact = np.concatenate(exact_pairs)
        pairs.append(np.concatenate([exact, np.full((len(exact), 1), EXACT_PAIR)], axis=1))
    if near_pairs:
        near = np.unique(np.concatenate(near_pairs), axis=0)
        kind = np.full(len(near), NEAR_PAIR, dtype=np.int64)
        if params.verify and len(near):
            docs = np.unique(near)
            signatures = _signature_rows(writer, names, docs, params.num_perm)
            similarity = minhash.estimated_jaccard(
                signatures[np.searchsorted(docs, near[:, 0])], signatures[np.searchsorted(docs, near[:, 1])]
            )
            kind[similarity < params.verify_cutoff] = REJECTED_PAIR
        pairs.append(np.concatenate([near, kind[:, None]], axis=1))
    task = bucket_task_name(bands, hash_range)
    local = os.path.join(writer.local_dir, "pairs", f"{task}.npy")
    os.makedirs(os.path.dirname(local), exist_ok=True)
    np.save(local, np.concatenate(pairs))
    writer.commit_shard(task, {f"pairs/{task}.npy": local})
    return {"pairs": sum(len(p) for p in pairs)}


def union_pairs(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documents in accepted pairs (sorted ids) and each one's cluster root, the cluster's earliest id."""
    edges = pairs[pairs[:, 2] != REJECTED_PAIR, :2]
    members = np.unique(edges)
    union_find = minhash.UnionFind(len(members))
    union_find.union_pairs(np.searchsorted(members, edges[:, 0]), np.searchsorted(members, edges[:, 1]))
    return members, members[union_find.roots()]  # compact indices keep the ids' order


def cluster_shard(writer: ArtifactWriter, source: ArtifactRef, names: list[str], tasks: list[str]) -> dict:
    """Union-find over the candidate pairs; the report, one file per input shard, and the cluster counts."""
    pairs = np.concatenate(
        [np.zeros((0, 3), dtype=np.int64)] + [read_committed_npy(writer, f"pairs/{t}.npy") for t in tasks]
    )
    near = np.unique(pairs[pairs[:, 2] != EXACT_PAIR], axis=0)  # a pair found in several bands counts once
    members, roots = union_pairs(pairs)
    cluster_roots, sizes = np.unique(roots, return_counts=True)
    size_of = dict(zip(cluster_roots.tolist(), sizes.tolist(), strict=True))
    root_id: dict[int, str] = {}  # filled shard by shard: a root precedes its members, so it is met first
    root_exact: dict[int, int] = {}
    files, dropped = {}, {"exact": 0, "near": 0}
    for index, name in enumerate(names):
        start, stop = np.searchsorted(members, [index << ROW_BITS, (index + 1) << ROW_BITS])
        member, root = members[start:stop].tolist(), roots[start:stop].tolist()
        rows = [m & ((1 << ROW_BITS) - 1) for m in member]
        ids, exact = [], []
        if member:
            ids = read_parquet_columns(source.local_path(shard_file(name)), ["id"]).column("id")
            ids = ids.take(pa.array(rows)).to_pylist()
            exact = read_committed_npy(writer, _minhash_files(name)["exact"])[rows].tolist()
        for m, r, doc_id, key in zip(member, root, ids, exact, strict=True):
            if m == r:
                root_id[m], root_exact[m] = doc_id, key
        kind = [
            None if m == r else "exact" if key == root_exact[r] else "near"
            for m, r, key in zip(member, root, exact, strict=True)
        ]
        dropped["exact"] += kind.count("exact")
        dropped["near"] += kind.count("near")
        table = {
            "id": ids,
            "shard": [name] * len(member),
            "row": rows,
            "cluster": [root_id[r] for r in root],
            "cluster_size": [size_of[r] for r in root],
            "kept": [m == r for m, r in zip(member, root, strict=True)],
            "kind": kind,
        }
        files[report_file(name)] = os.path.join(writer.local_dir, report_file(name))
        write_parquet_table(pa.table(table, schema=REPORT_SCHEMA), files[report_file(name)])
    counts = {
        "dropped": dropped,
        "clusters": len(cluster_roots),
        "candidate_pairs": len(near),
        "rejected_pairs": int((near[:, 2] == REJECTED_PAIR).sum()),
    }
    files[stats_file(CLUSTERS)] = write_json(counts, os.path.join(writer.local_dir, stats_file(CLUSTERS)))
    writer.commit_shard(CLUSTERS, files)
    return counts


def write_kept_shard(writer: ArtifactWriter, source: ArtifactRef, name: str) -> dict:
    """Copy one input shard without the rows its report drops; commit it with its counts."""
    table = read_parquet_columns(source.local_path(shard_file(name)))
    with writer.fs.open(f"{writer.path}/{report_file(name)}", "rb") as f:
        report = pq.read_table(f, columns=["row", "kept"])
    keep = np.ones(table.num_rows, dtype=bool)
    keep[report.filter(pc.invert(report.column("kept"))).column("row").to_numpy()] = False
    kept = table.filter(pa.array(keep))
    stats = {
        "docs_in": table.num_rows,
        "docs_out": kept.num_rows,
        "bytes_in": pc.sum(pc.binary_length(table.column("text"))).as_py() or 0,
        "bytes_out": pc.sum(pc.binary_length(kept.column("text"))).as_py() or 0,
    }
    scratch = os.path.join(writer.local_dir, name)
    files = {
        shard_file(name): os.path.join(scratch, "docs.parquet"),
        stats_file(name): os.path.join(scratch, "stats.json"),
    }
    write_parquet_table(kept, files[shard_file(name)])
    write_json(stats, files[stats_file(name)])
    writer.commit_shard(name, files)
    return stats


class DedupStage(Stage):
    name = "dedup"
    version = "3"  # 3: multiply-add signatures modulo 2**32
    libraries = ("pyarrow", "numpy", "xxhash")
    Params = DedupParams
    maps_shards = True

    def run(
        self,
        params: DedupParams,
        inputs: Inputs,
        store: ArtifactStore,
        map_shards: MapShards | None = None,
    ) -> ArtifactRef:
        """Deduplicate the documents of one upstream artifact (clean's); `map_shards`: a local process pool
        unless a flow passes its own."""
        (source,) = expect_inputs(self, inputs, 1, "one artifact of document shards (clean's)")
        map_shards = map_shards or process_pool()

        def build(writer: ArtifactWriter) -> dict:
            names = document_shards(source)
            started = time.time()
            docs = sum(shard_rows(source, n) for n in names)
            ranges, tasks = bucket_tasks(params, docs)
            minhash_args = [(writer, source, n, params, ranges) for n in names]
            run_shards(writer, minhash_shard, minhash_args, [f"minhash-{n}" for n in names], map_shards)
            signatures_seconds = time.time() - started
            task_names = [bucket_task_name(bands, r) for bands, r in tasks]
            bucket_args = [(writer, names, params, bands, r, ranges) for bands, r in tasks]
            run_shards(writer, bucket_shard, bucket_args, task_names, map_shards)
            cluster_args = [(writer, source, names, task_names)]
            run_shards(writer, cluster_shard, cluster_args, [CLUSTERS], map_shards)
            clusters = read_committed_json(writer, stats_file(CLUSTERS))
            run_shards(writer, write_kept_shard, [(writer, source, n) for n in names], names, map_shards)
            counts = sum_counts(shard_stats(writer, names))
            seconds = time.time() - started
            log.info(
                "dedup: %d of %d documents kept (%d exact, %d near duplicates dropped) in %.1f s (%.0f docs/s)",
                counts["docs_out"],
                docs,
                clusters["dropped"]["exact"],
                clusters["dropped"]["near"],
                seconds,
                docs / max(seconds, 1e-9),
            )
            return {
                "counts": {**counts, **clusters},
                "lsh": {
                    "verify_cutoff": round(params.verify_cutoff, 6),
                    "probability_at_threshold": round(
                        minhash.candidate_probability(params.threshold, params.bands, params.rows), 6
                    ),
                    "hash_ranges": ranges,
                    "bucket_tasks": len(tasks),
                },
                "throughput": {
                    "signature_docs_per_s": round(docs / max(signatures_seconds, 1e-9), 1),
                    "docs_per_s": round(docs / max(seconds, 1e-9), 1),
                },
            }

        return self.build_artifact(params, [source], store, build)


STAGE = DedupStage()
run = STAGE.run
key = STAGE.key
