"""Dedup at scale: peak memory of every process of the dedup stage as the corpus grows, docs/s at each size,
recall on planted near duplicates, and datatrove's MinHash pipeline at the largest size in the same run.

Corpus of each size: ~2 KB documents, each a random draw of lines of GCIDE entries and KJV verses (the shared corpora,
../shared/corpora), so documents are distinct however large the corpus; then, after every 10,000 of them,
near copies of 5% of those with 2 to 5 words changed (Jaccard ~0.85-0.95 on word 5-grams). Written as Parquet
shards (download stage, 10,000 documents per shard).

Each engine runs in a fresh process (`--child`); its peak RSS (VmHWM, the stage's process: the cluster step
runs there) and the largest of its descendants' (the pool workers running signature, bucket and kept-document
tasks) are sampled from /proc. The stage's memory must stay flat (within 20%) from the smallest to the
largest size. Datatrove: MinhashDedupSignature -> Buckets -> Cluster -> Filter as in `benchmarks/dedup.py`
(14 buckets x 8 hashes), same workers. Ends with `ratio: <ours/datatrove docs/s at the largest size>`.

    .venv/bin/python -m benchmarks.dedup_scale [--sizes-mb 128,1024] [--workers 2] [--no-datatrove]
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
CORPORA = ROOT.parent / "shared" / "corpora"
DOC_BYTES = 2000
DOCS_PER_SHARD = 10_000
DUPLICATE_FRACTION = 0.05
FLAT = 1.2  # the largest size's peak RSS over the smallest's


def text_pool() -> list[str]:
    """The lines of GCIDE's entries and KJV's verses with five words or more: the pieces documents are drawn
    from (whole entries would not do: a document of one long entry would repeat wherever that entry is drawn)."""
    pieces = []
    for name in ("gcide.jsonl.xz", "kjv.jsonl.xz"):
        with lzma.open(CORPORA / name, "rt") as f:
            for line in f:
                pieces.extend(p for p in json.loads(line)["text"].split("\n") if len(p.split()) >= 5)
    return pieces


def documents(pool: list[str], megabytes: float, seed: int) -> Iterator[list[dict]]:
    """Batches of DOCS_PER_SHARD random documents followed by the near copies of 5% of them."""
    rng = random.Random(seed)
    made = size = 0
    while size < megabytes * 1e6:
        batch = []
        for _ in range(DOCS_PER_SHARD):
            parts, length = [], 0
            while length < DOC_BYTES:
                parts.append(rng.choice(pool))
                length += len(parts[-1]) + 1
            batch.append({"id": f"doc-{made}", "text": "\n".join(parts)})
            made, size = made + 1, size + length
        for original in rng.sample(batch, int(len(batch) * DUPLICATE_FRACTION)):
            words = original["text"].split(" ")
            for i in rng.sample(range(len(words)), rng.randint(2, 5)):
                words[i] = f"planted{rng.randrange(10**6)}"
            batch.append({"id": f"copy-of-{original['id']}", "text": " ".join(words)})
        yield batch


def build_source(pool: list[str], megabytes: float, workdir: Path):
    """The download artifact of a corpus of `megabytes`; (ref, documents, text MB, planted copy ids)."""
    from stages import download
    from storage.artifacts import ArtifactStore
    from storage.documents import write_parquet_shard

    raw = workdir / "raw"
    raw.mkdir()
    docs, text_bytes, planted = 0, 0, set()
    for index, batch in enumerate(documents(pool, megabytes, seed=0)):
        write_parquet_shard(batch, str(raw / f"{index:05d}.parquet"))
        docs += len(batch)
        text_bytes += sum(len(d["text"].encode()) for d in batch)
        planted |= {d["id"] for d in batch if d["id"].startswith("copy-of-")}
    params = download.DownloadParams(source=str(raw / "*.parquet"), docs_per_shard=DOCS_PER_SHARD)
    ref = download.run(params, [], ArtifactStore(str(workdir / "source")))
    return ref, docs, text_bytes / 1e6, planted


def descendants(root: int) -> list[int]:
    """`root` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    tree, stack = [], [root]
    while stack:
        tree.append(stack.pop())
        stack.extend(children.get(tree[-1], []))
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far, 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0.0


def run_child(engine: str, source: dict, workdir: Path, workers: int) -> dict:
    """Run one engine in a fresh process; its seconds, removed ids, the peak RSS (MB) of that process and of the
    largest of its descendants, and the CPU seconds of them all, sampled from /proc every 50 ms."""
    command = [sys.executable, "-m", "benchmarks.dedup_scale", "--child", engine, json.dumps(source)]
    command += [str(workdir), str(workers)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, float] = {}
    cpu: dict[int, float] = {}

    def sample() -> None:
        while process.poll() is None:
            for pid in descendants(process.pid):
                peaks[pid] = max(peaks.get(pid, 0.0), peak_rss_mb(pid))
                cpu[pid] = max(cpu.get(pid, 0.0), cpu_seconds(pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    stdout, stderr = process.communicate()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{engine} failed:\n{stderr[-3000:]}")
    workers_peak = max((mb for pid, mb in peaks.items() if pid != process.pid), default=0.0)
    rss = {"main": peaks.get(process.pid, 0.0), "workers": workers_peak}
    return {**json.loads(stdout.strip().splitlines()[-1]), "rss_mb": rss, "cpu_seconds": sum(cpu.values())}


def child(engine: str, source_json: str, workdir: str, workers: int) -> None:
    """The body of `--child`: run the engine, print one JSON line (seconds, removed ids)."""
    from stages import dedup
    from stages.shards import process_pool
    from storage.artifacts import ArtifactStore

    source = ArtifactStore(str(Path(workdir) / "unused")).ref(json.loads(source_json))
    started = time.perf_counter()
    if engine == "ours":
        store = ArtifactStore(str(Path(workdir) / "ours"))
        ref = dedup.run(dedup.DedupParams(), [source], store, map_shards=process_pool(workers))
        report = pq.read_table(ref.local_path("duplicates.parquet"), columns=["id", "kept"]).to_pylist()
        removed = [row["id"] for row in report if not row["kept"]]
    else:
        from benchmarks.dedup import run_datatrove

        shards = Path(source.url) / "shards"
        n_shards = len(list(shards.glob("*.parquet")))
        removed = sorted(run_datatrove(str(shards), n_shards, Path(workdir) / "datatrove", workers))
    print(json.dumps({"seconds": time.perf_counter() - started, "removed": removed}))


def quality(removed: set[str], planted: set[str]) -> tuple[float, float]:
    found = len(removed & planted)
    return found / max(len(planted), 1), found / max(len(removed), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="128,1024", help="corpus sizes in MB of text, comma-separated")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-datatrove", action="store_true", help="skip datatrove at the largest size")
    parser.add_argument(
        "--child", nargs=4, metavar=("ENGINE", "SOURCE", "WORKDIR", "WORKERS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        engine, source, workdir, workers = args.child
        child(engine, source, workdir, int(workers))
        return
    if not (CORPORA / "gcide.jsonl.xz").exists():
        print(f"skipped: {CORPORA}/gcide.jsonl.xz not found (shared corpora absent)")
        return

    sizes = [float(s) for s in args.sizes_mb.split(",")]
    pool = text_pool()
    results = {}
    for megabytes in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            ref, docs, text_mb, planted = build_source(pool, megabytes, Path(tmp))
            engines = ["ours"] + (["datatrove"] if megabytes == max(sizes) and not args.no_datatrove else [])
            for engine in engines:
                result = run_child(engine, ref.to_dict(), Path(tmp), args.workers)
                recall, precision = quality(set(result["removed"]), planted)
                results[engine, megabytes] = {
                    **result,
                    "docs_per_s": docs / result["seconds"],
                    "docs_per_cpu_s": docs / result["cpu_seconds"],
                    "recall": recall,
                }
                print(
                    f"{engine:>9} {megabytes:6.0f} MB: {docs:8d} docs ({text_mb:7.1f} MB text), "
                    f"{result['seconds']:7.1f} s, {docs / result['seconds']:8.0f} docs/s "
                    f"({docs / result['cpu_seconds']:.0f} per CPU second, sampled), "
                    f"peak RSS main {result['rss_mb']['main']:6.0f} MB, workers {result['rss_mb']['workers']:6.0f} MB, "
                    f"recall {recall:.4f}, precision {precision:.4f} ({len(planted)} planted)",
                    flush=True,
                )
    small, large = results["ours", min(sizes)], results["ours", max(sizes)]
    for who in ("main", "workers"):
        growth = large["rss_mb"][who] / small["rss_mb"][who]
        flat = "yes" if growth <= FLAT else "NO"
        print(
            f"peak RSS {who}: x{growth:.2f} from {min(sizes):.0f} MB to {max(sizes):.0f} MB (flat within 20%: {flat})"
        )
    if ("datatrove", max(sizes)) in results:
        theirs = results["datatrove", max(sizes)]
        print(f"recall at {max(sizes):.0f} MB: ours {large['recall']:.4f}, datatrove {theirs['recall']:.4f}")
        print(
            f"docs per CPU second, ours / datatrove: {large['docs_per_cpu_s'] / theirs['docs_per_cpu_s']:.3f}"
        )
        print(f"ratio: {large['docs_per_s'] / theirs['docs_per_s']:.3f}")


if __name__ == "__main__":
    main()
