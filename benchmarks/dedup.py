"""MinHash near-duplicate removal: our dedup stage vs datatrove's MinHash pipeline, same data, same cores.

Data: GCIDE dictionary entries (../shared/corpora/gcide.jsonl.xz) concatenated into ~2 KB documents, plus
planted near duplicates: copies of 5% of the documents with 2 to 5 words changed (Jaccard ~0.85-0.95 on
word 5-grams), placed after all originals. Both tools read the same Parquet shards, use word 5-grams on
whitespace-split normalised text, and run with the same number of worker processes.

Ours: DedupParams() (20 bands x 5 rows = 100 permutations, verified at Jaccard 0.8), the whole stage
(signatures, LSH, union-find, duplicates report, kept Parquet shards). Datatrove: MinhashDedupSignature ->
Buckets -> Cluster -> Filter with LocalPipelineExecutor, its default 14 buckets x 8 hashes (112), writing
kept documents as Parquet. Reported: docs/s (median of repeats), recall and precision on the planted
copies; last line `ratio: <ours/datatrove>` (docs/s).

    .venv/bin/python -m benchmarks.dedup [--megabytes 24] [--workers 2] [--repeats 3]
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import argparse  # noqa: E402
import json  # noqa: E402
import lzma  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import pyarrow.parquet as pq  # noqa: E402
import xxhash  # noqa: E402
from datatrove.executor import LocalPipelineExecutor  # noqa: E402
from datatrove.pipeline.dedup.minhash import (  # noqa: E402
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
)
from datatrove.pipeline.readers import ParquetReader  # noqa: E402
from datatrove.pipeline.writers import ParquetWriter  # noqa: E402
from datatrove.utils.word_tokenizers import WordTokenizer  # noqa: E402

from stages import dedup, download  # noqa: E402
from stages.shards import process_pool  # noqa: E402
from storage.artifacts import ArtifactStore  # noqa: E402
from storage.documents import write_parquet_shard  # noqa: E402

GCIDE = ROOT.parent / "shared" / "corpora" / "gcide.jsonl.xz"
DOC_BYTES = 2000
DUPLICATE_FRACTION = 0.05


class SplitTokenizer(WordTokenizer):
    """Whitespace words, like ours (datatrove's English tokenizer needs spaCy, not installed here)."""

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        return [text]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [(0, len(text))]


def xxhash64_text(text: str) -> int:
    return xxhash.xxh64_intdigest(text.encode())


class Signature(MinhashDedupSignature):
    """Datatrove's signature step with its own xxhash64 shingle hash, encoding the text first: datatrove 0.10
    passes str, which xxhash >= 4 no longer accepts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hash_func = xxhash64_text


def build_corpus(megabytes: float, seed: int = 0) -> tuple[list[dict], set[str]]:
    """~2 KB documents of consecutive GCIDE entries, then near copies of 5% of them; the copies' ids."""
    docs: list[dict] = []
    parts: list[str] = []
    size = 0
    with lzma.open(GCIDE, "rt") as f:
        for line in f:
            parts.append(json.loads(line)["text"])
            size += len(parts[-1])
            if size >= DOC_BYTES:
                docs.append({"id": f"doc-{len(docs)}", "text": "\n".join(parts)})
                parts, size = [], 0
                if len(docs) * DOC_BYTES >= megabytes * 1e6:
                    break
    rng = random.Random(seed)
    copies = []
    for original in rng.sample(docs, int(len(docs) * DUPLICATE_FRACTION)):
        words = original["text"].split(" ")
        for i in rng.sample(range(len(words)), rng.randint(2, 5)):
            words[i] = f"planted{rng.randrange(10**6)}"
        copies.append({"id": f"copy-of-{original['id']}", "text": " ".join(words)})
    return docs + copies, {c["id"] for c in copies}


def quality(removed: set[str], planted: set[str]) -> tuple[float, float]:
    found = len(removed & planted)
    return found / len(planted), found / max(len(removed), 1)


def run_ours(source, workdir: Path, workers: int) -> set[str]:
    ref = dedup.run(
        dedup.DedupParams(), [source], ArtifactStore(str(workdir / "ours")), map_shards=process_pool(workers)
    )
    report = pq.read_table(ref.local_path("duplicates.parquet")).to_pylist()
    return {row["id"] for row in report if not row["kept"]}


def run_datatrove(shards_dir: str, n_shards: int, workdir: Path, workers: int) -> set[str]:
    config = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)
    out = workdir / "datatrove"

    def reader():
        return ParquetReader(shards_dir, glob_pattern="*.parquet")

    def executor(pipeline, tasks, depends=None):
        logs = str(out / f"logs-{len(pipeline)}-{tasks}-{id(pipeline)}")
        return LocalPipelineExecutor(
            pipeline, tasks=tasks, workers=workers, logging_dir=logs, depends=depends
        )

    signatures = executor(
        [reader(), Signature(str(out / "sigs"), config=config, language=SplitTokenizer())],
        n_shards,
    )
    buckets = executor(
        [MinhashDedupBuckets(str(out / "sigs"), str(out / "buckets"), config=config)],
        config.num_buckets,
        signatures,
    )
    cluster = executor(
        [MinhashDedupCluster(str(out / "buckets"), str(out / "remove"), config=config)], 1, buckets
    )
    filtered = executor(
        [
            reader(),
            MinhashDedupFilter(str(out / "remove"), exclusion_writer=ParquetWriter(str(out / "removed"))),
            ParquetWriter(str(out / "kept")),
        ],
        n_shards,
        cluster,
    )
    filtered.run()
    return {
        row
        for f in sorted((out / "removed").glob("*.parquet"))
        for row in pq.read_table(f).column("id").to_pylist()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=24.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--docs-per-shard", type=int, default=2000)
    args = parser.parse_args()
    if not GCIDE.exists():
        print(f"skipped: {GCIDE} not found (shared corpora absent)")
        return

    docs, planted = build_corpus(args.megabytes)
    text_mb = sum(len(d["text"].encode()) for d in docs) / 1e6
    print(f"corpus: {len(docs)} documents, {text_mb:.1f} MB, {len(planted)} planted near duplicates")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        corpus = tmp_path / "corpus.parquet"
        write_parquet_shard(docs, str(corpus))
        params = download.DownloadParams(source=str(corpus), docs_per_shard=args.docs_per_shard)
        source = download.run(params, [], ArtifactStore(str(tmp_path / "source")))
        shards_dir = str(Path(source.url) / "shards")
        n_shards = len(source.files("shards/"))

        timings: dict[str, list[float]] = {"ours": [], "datatrove": []}
        removed: dict[str, set[str]] = {}
        for repeat in range(args.repeats):
            for name in ("ours", "datatrove"):
                workdir = tmp_path / f"{name}-{repeat}"
                started = time.perf_counter()
                if name == "ours":
                    removed[name] = run_ours(source, workdir, args.workers)
                else:
                    removed[name] = run_datatrove(shards_dir, n_shards, workdir, args.workers)
                timings[name].append(time.perf_counter() - started)
                shutil.rmtree(workdir, ignore_errors=True)
                print(f"  repeat {repeat} {name}: {timings[name][-1]:.2f} s", flush=True)

    docs_per_s = {name: len(docs) / statistics.median(t) for name, t in timings.items()}
    for name in ("ours", "datatrove"):
        recall, precision = quality(removed[name], planted)
        print(
            f"{name:>9}: {docs_per_s[name]:9.1f} docs/s ({text_mb / statistics.median(timings[name]):.2f} MB/s), "
            f"removed {len(removed[name])}, recall {recall:.4f}, precision {precision:.4f}"
        )
    print(f"ratio: {docs_per_s['ours'] / docs_per_s['datatrove']:.3f}")


if __name__ == "__main__":
    main()
