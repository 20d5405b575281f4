"""Dedup stage: exact and near-duplicate (MinHash-LSH) removal, keeping the first document of each cluster.

1. per input shard, in parallel: exact keys (64-bit hash of the normalised text) and, for near dedup, MinHash
   signatures and LSH band keys, committed as shard `minhash-<name>` (`minhash/<name>.*.npy`);
2. in the parent: documents sharing an exact key or an LSH bucket are candidates; near candidates are
   optionally verified by their estimated Jaccard similarity; union-find merges them into clusters, and the
   smallest (shard, row) of each cluster is kept. `duplicates.parquet` lists every document of a cluster;
3. per input shard, in parallel: the kept documents, committed as `shards/<name>.parquet`.

A rerun after a crash reuses the committed signature and document shards and writes identical bytes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from stages import minhash
from stages.base import Inputs, Stage, expect_inputs
from stages.shards import (
    MapShards,
    document_shards,
    log,
    process_pool,
    read_committed_npy,
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


def _minhash_files(name: str) -> dict[str, str]:
    return {part: f"minhash/{name}.{part}.npy" for part in ("exact", "bands", "signatures")}


def minhash_shard(writer: ArtifactWriter, source: ArtifactRef, name: str, params: DedupParams) -> dict:
    """Exact keys, band keys and MinHash signatures of one input shard."""
    texts = read_parquet_columns(source.local_path(shard_file(name)), ["text"]).column("text").to_pylist()
    normalized = [minhash.normalize_for_dedup(t) for t in texts]
    arrays = {"exact": np.array([xxhash.xxh3_64_intdigest(t.encode()) for t in normalized], dtype=np.uint64)}
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
        arrays["bands"] = minhash.band_keys(signatures, params.bands, params.rows)
        arrays["signatures"] = signatures
    files = {}
    for part, array in arrays.items():
        relative = _minhash_files(name)[part]
        files[relative] = os.path.join(writer.local_dir, relative)
        os.makedirs(os.path.dirname(files[relative]), exist_ok=True)
        np.save(files[relative], array)
    writer.commit_shard(f"minhash-{name}", files)
    return {"docs": len(texts)}


def write_kept_shard(writer: ArtifactWriter, source: ArtifactRef, name: str, drop_rows: list[int]) -> dict:
    """Copy one input shard without the rows in `drop_rows`; commit it with its counts."""
    table = read_parquet_columns(source.local_path(shard_file(name)))
    keep = np.ones(table.num_rows, dtype=bool)
    keep[drop_rows] = False
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


@dataclass
class Clusters:
    """Each document's cluster root (the kept document's global index) and how it was found."""

    offsets: np.ndarray  # global index of each shard's first document, then the total
    roots: np.ndarray
    exact: np.ndarray  # the document's exact key equals its root's
    candidate_pairs: int  # LSH candidates
    rejected_pairs: int  # LSH candidates whose estimated Jaccard is below the verification cutoff


def _gather_signatures(
    writer: ArtifactWriter, names: list[str], offsets: np.ndarray, index: np.ndarray
) -> np.ndarray:
    """Signature rows of the documents at global `index`, loading one shard's signatures at a time."""
    shard_of = np.searchsorted(offsets, index, side="right") - 1
    rows = []
    for shard in np.unique(shard_of):
        signatures = read_committed_npy(writer, _minhash_files(names[shard])["signatures"])
        rows.append(signatures[index[shard_of == shard] - offsets[shard]])
    gathered = np.concatenate(rows)
    # Rows came grouped by shard: put them back in the order of `index`.
    out = np.empty_like(gathered)
    out[np.argsort(shard_of, kind="stable")] = gathered
    return out


def find_clusters(writer: ArtifactWriter, names: list[str], params: DedupParams) -> Clusters:
    """Candidate pairs from exact keys and LSH buckets, verified, merged by union-find."""
    exact_keys = [read_committed_npy(writer, _minhash_files(n)["exact"]) for n in names]
    offsets = np.cumsum([0, *(len(k) for k in exact_keys)])
    exact = np.concatenate(exact_keys)
    union_find = minhash.UnionFind(len(exact))
    if params.exact:
        union_find.union_pairs(*minhash.bucket_pairs(exact[:, None]))
    candidate_pairs = rejected_pairs = 0
    if params.near:
        bands = np.concatenate([read_committed_npy(writer, _minhash_files(n)["bands"]) for n in names])
        first, other = minhash.bucket_pairs(bands)
        candidate_pairs = len(first)
        if params.verify:
            # Exact duplicates need no verification; the others need enough equal signature values.
            check = np.flatnonzero(exact[first] != exact[other])
            accept = np.ones(len(first), dtype=bool)
            if len(check):
                accept[check] = (
                    minhash.estimated_jaccard(
                        _gather_signatures(writer, names, offsets, first[check]),
                        _gather_signatures(writer, names, offsets, other[check]),
                    )
                    >= params.verify_cutoff
                )
            rejected_pairs = int((~accept).sum())
            first, other = first[accept], other[accept]
        union_find.union_pairs(first, other)
    roots = union_find.roots()
    return Clusters(offsets, roots, exact == exact[roots], candidate_pairs, rejected_pairs)


def duplicates_table(source: ArtifactRef, names: list[str], clusters: Clusters) -> pa.Table:
    """One row per document in a cluster of two or more: id, shard, row, cluster (the kept document's id),
    cluster_size, kept, kind (exact or near; null for the kept document)."""
    sizes = np.bincount(clusters.roots, minlength=len(clusters.roots))
    members = np.flatnonzero(sizes[clusters.roots] > 1)
    shard_of = np.searchsorted(clusters.offsets, members, side="right") - 1
    ids = np.empty(len(clusters.roots), dtype=object)
    for shard in np.unique(shard_of):  # every root is a member too
        shard_ids = read_parquet_columns(source.local_path(shard_file(names[shard])), ["id"]).column("id")
        ids[clusters.offsets[shard] : clusters.offsets[shard + 1]] = shard_ids.to_pylist()
    kept = clusters.roots[members] == members
    kind = np.where(kept, None, np.where(clusters.exact[members], "exact", "near"))
    return pa.table(
        {
            "id": pa.array(ids[members].tolist(), type=pa.string()),
            "shard": pa.array([names[s] for s in shard_of], type=pa.string()),
            "row": pa.array(members - clusters.offsets[shard_of], type=pa.int64()),
            "cluster": pa.array(ids[clusters.roots[members]].tolist(), type=pa.string()),
            "cluster_size": pa.array(sizes[clusters.roots[members]], type=pa.int64()),
            "kept": pa.array(kept, type=pa.bool_()),
            "kind": pa.array(kind.tolist(), type=pa.string()),
        }
    )


class DedupStage(Stage):
    name = "dedup"
    version = "1"
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
            minhash_args = [(writer, source, n, params) for n in names]
            run_shards(writer, minhash_shard, minhash_args, [f"minhash-{n}" for n in names], map_shards)
            signatures_seconds = time.time() - started
            clusters = find_clusters(writer, names, params)
            report = os.path.join(writer.local_dir, "duplicates.parquet")
            write_parquet_table(duplicates_table(source, names, clusters), report)
            writer.put_file(report, "duplicates.parquet")

            dropped = np.flatnonzero(clusters.roots != np.arange(len(clusters.roots)))
            shard_of = np.searchsorted(clusters.offsets, dropped, side="right") - 1
            drop_rows = [(dropped[shard_of == s] - clusters.offsets[s]).tolist() for s in range(len(names))]
            kept_args = [(writer, source, n, rows) for n, rows in zip(names, drop_rows, strict=True)]
            run_shards(writer, write_kept_shard, kept_args, names, map_shards)
            counts = sum_counts(shard_stats(writer, names))
            exact_drops = int(clusters.exact[dropped].sum())
            docs = len(clusters.roots)
            seconds = time.time() - started
            log.info(
                "dedup: %d of %d documents kept (%d exact, %d near duplicates dropped) in %.1f s (%.0f docs/s)",
                counts["docs_out"],
                docs,
                exact_drops,
                len(dropped) - exact_drops,
                seconds,
                docs / max(seconds, 1e-9),
            )
            return {
                "counts": {
                    **counts,
                    "dropped": {"exact": exact_drops, "near": len(dropped) - exact_drops},
                    "clusters": int((np.bincount(clusters.roots, minlength=docs) > 1).sum()),
                    "candidate_pairs": clusters.candidate_pairs,
                    "rejected_pairs": clusters.rejected_pairs,
                },
                "lsh": {
                    "verify_cutoff": round(params.verify_cutoff, 6),
                    "probability_at_threshold": round(
                        minhash.candidate_probability(params.threshold, params.bands, params.rows), 6
                    ),
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
