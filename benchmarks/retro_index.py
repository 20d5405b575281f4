"""Retro index: query throughput and recall@10 of our faiss index against exact search, in one run.

The index is built as `retro.index` builds it: `faiss.index_factory(--retro-index-str)`, trained on a
`--ntrain` sample, filled with `sa_encode` codes block by block (`retro.index.add_codes`), searched with
`--nprobe`/`--ef-search` set by `retro.index.set_search_parameters`. The peer is exact search
(`IndexFlatL2`) over the same vectors with the same queries and threads. Vectors are clustered random
vectors (a mixture of Gaussians, the shape of sentence embeddings of a topical corpus); the real
embedder comes with the BERT work. Throughput is the median of `--repeats` timed searches of all queries.

    .venv/bin/python -m benchmarks.retro_index [--num-vectors 200000] [--index-str IVF1024,Flat] [--nprobe 16]

Prints both throughputs and recall@10, and ends with `ratio: <ours qps / exact qps>`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import faiss
import numpy as np

from retro.index import add_codes, set_search_parameters


def clustered_vectors(
    count: int, dim: int, clusters: int, spread: float, rng: np.random.Generator
) -> np.ndarray:
    """`count` points around `clusters` standard-normal centres (the same centres for the same `rng` seed)."""
    centers = rng.standard_normal((clusters, dim)).astype(np.float32)
    labels = rng.integers(clusters, size=count)
    return centers[labels] + spread * rng.standard_normal((count, dim)).astype(np.float32)


def timed_search(index: faiss.Index, queries: np.ndarray, k: int, repeats: int) -> tuple[float, np.ndarray]:
    """(median seconds of one search of all queries, the neighbour ids)."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        _, ids = index.search(queries, k)
        times.append(time.perf_counter() - began)
    return statistics.median(times), ids


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-vectors", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--clusters", type=int, default=2000)
    parser.add_argument("--spread", type=float, default=1.0, help="noise around each cluster centre")
    parser.add_argument("--index-str", default="IVF1024,Flat")
    parser.add_argument("--ntrain", type=int, default=50_000)
    parser.add_argument("--block-size", type=int, default=50_000)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--ef-search", type=int, default=256)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="faiss OpenMP threads, the same for both")
    args = parser.parse_args()

    faiss.omp_set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    vectors = clustered_vectors(args.num_vectors, args.dim, args.clusters, args.spread, rng)
    queries = clustered_vectors(args.queries, args.dim, args.clusters, args.spread, np.random.default_rng(0))
    queries += 0.1 * rng.standard_normal(queries.shape).astype(np.float32)

    began = time.perf_counter()
    index = faiss.index_factory(args.dim, args.index_str)
    index.train(vectors[rng.choice(len(vectors), min(args.ntrain, len(vectors)), replace=False)])
    trained = time.perf_counter()
    add_codes(
        index,
        (index.sa_encode(vectors[s : s + args.block_size]) for s in range(0, len(vectors), args.block_size)),
    )
    filled = time.perf_counter()
    set_search_parameters(index, args.nprobe, args.ef_search)
    exact = faiss.IndexFlatL2(args.dim)
    exact.add(vectors)

    ours_s, found = timed_search(index, queries, 10, args.repeats)
    exact_s, truth = timed_search(exact, queries, 10, args.repeats)
    recall = np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth, strict=True)])
    print(
        f"{args.num_vectors} vectors of dim {args.dim}, {args.queries} queries, {args.threads} thread(s); "
        f"{args.index_str} trained in {trained - began:.1f} s, filled in {filled - trained:.1f} s"
    )
    print(
        f"ours  {args.index_str} nprobe={args.nprobe}: {args.queries / ours_s:10.0f} queries/s (median {ours_s:.4f} s)"
    )
    print(f"exact IndexFlatL2: {args.queries / exact_s:10.0f} queries/s (median {exact_s:.4f} s)")
    print(f"recall@10: {recall:.4f}")
    print(f"ratio: {exact_s / ours_s:.3f}")


if __name__ == "__main__":
    main()
