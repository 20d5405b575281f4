"""stages/minhash.py and stages/dedup.py: planted exact and near duplicates found exactly, the first
occurrence kept, the report, cache hits, and a SIGKILLed run resumed to byte-identical output."""

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from stages import clean, dedup, download, minhash
from stages.dedup import DedupParams
from stages.shards import process_pool, read_committed_npy_ranges
from storage.artifacts import ArtifactStore
from storage.documents import BadRecordError, iter_records

ROOT = Path(__file__).resolve().parents[1]
SERIAL = process_pool(1)
# Genesis chapters: long, distinct real text (412 to 1,816 words).
BASE = [r.data for r in iter_records(download.EMBEDDED_CORPUS) if r.data["id"].startswith("kjv-Ge-")]
EXACT_COPIES = {"copy-ge-2": "kjv-Ge-2", "copy-ge-7": "kjv-Ge-7", "copy-ge-7b": "kjv-Ge-7"}
NEAR_COPIES = {
    "near-ge-12": "kjv-Ge-12",
    "near-ge-24": "kjv-Ge-24",
    "near-ge-30": "kjv-Ge-30",
    "near-ge-41": "kjv-Ge-41",
}


def _change_words(text: str, count: int, seed: int) -> str:
    rng = random.Random(seed)
    words = text.split(" ")
    for i in rng.sample(range(len(words)), count):
        words[i] = f"changed{i}"
    return " ".join(words)


def _corpus() -> list[dict]:
    """Genesis, then exact copies (case, spacing and punctuation changed) and 3-word near copies."""
    by_id = {d["id"]: d["text"] for d in BASE}
    docs = [{"id": d["id"], "text": d["text"]} for d in BASE]
    for i, (new_id, original) in enumerate(EXACT_COPIES.items()):
        text = (
            by_id[original].upper() if i == 0 else by_id[original].replace(",", " ,").replace("\n", "  \n ")
        )
        docs.append({"id": new_id, "text": text})
    for seed, (new_id, original) in enumerate(NEAR_COPIES.items()):
        docs.append({"id": new_id, "text": _change_words(by_id[original], 3, seed)})
    return docs


@pytest.fixture(scope="module")
def corpus_ref(tmp_path_factory):
    root = tmp_path_factory.mktemp("dedup")
    path = root / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in _corpus()))
    store = ArtifactStore(str(root / "store"))
    return download.run(download.DownloadParams(source=str(path), docs_per_shard=12), [], store)


def test_download_clean_dedup_counts_per_stage(tmp_path):
    junk = [
        {"id": "junk-short", "text": "Too short to keep."},
        {"id": "junk-lorem", "text": BASE[3]["text"] + "\nLorem ipsum dolor sit amet."},
        {"id": "junk-code", "text": BASE[4]["text"] + "\nvar x = {a: 1};"},
    ]
    lines = [json.dumps(d) for d in _corpus()[:20] + junk + _corpus()[len(BASE) :]]
    lines.insert(5, '{"id": "broken", "text": ')  # one malformed record
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    store = ArtifactStore(str(tmp_path / "store"))
    with pytest.raises(BadRecordError, match=r"corpus.jsonl:6: not valid JSON"):
        download.run(download.DownloadParams(source=str(path), docs_per_shard=8), [], store)
    docs = download.run(
        download.DownloadParams(source=str(path), docs_per_shard=8, skip_bad_records=True), [], store
    )
    assert docs.manifest()["counts"]["skipped_bad_records"] == 1
    assert docs.manifest()["counts"]["docs"] == 20 + 3 + 7
    # Genesis is too repetitive for Gopher's n-gram rules (tested in test_clean.py): off here.
    params = clean.CleanParams(max_duplicate_ngram_chars_fraction=None, max_top_ngram_chars_fraction=None)
    cleaned = clean.run(params, [docs], store, map_shards=SERIAL)
    dropped = {rule: n for rule, n in cleaned.manifest()["counts"]["dropped"].items() if n}
    assert dropped == {"too_few_words": 1, "c4_lorem_ipsum": 1, "c4_curly_brace": 1}
    deduped = dedup.run(DedupParams(), [cleaned], store, map_shards=SERIAL)
    counts = deduped.manifest()["counts"]
    # Near copies of chapters beyond the first 20 have no original here: they are kept.
    assert counts["dropped"] == {"exact": 3, "near": 1}
    assert counts["docs_out"] == 20 + 3


def test_shingle_hashes_respect_document_boundaries_and_short_documents():
    hashes, counts = minhash.shingle_hashes(["a b c d e f", "", "x y", "a b c d e"], 5)
    assert counts.tolist() == [2, 0, 1, 1]
    # Same n-gram, same hash, wherever it sits; a short document is one shingle of all its words.
    assert hashes[0] == hashes[3]
    solo, _ = minhash.shingle_hashes(["x y"], 5)
    assert solo[0] == hashes[2]


@pytest.mark.parametrize("changed", [0, 20, 100, 400])
def test_estimated_jaccard_tracks_true_jaccard(changed):
    rng = random.Random(0)
    words = [f"w{rng.randrange(10**6)}" for _ in range(2000)]
    a, b = minhash.permutations(256, seed=3)
    other = words[:]
    for i in rng.sample(range(len(words)), changed):
        other[i] = f"x{i}"
    sh = [{tuple(w[i : i + 5]) for i in range(len(w) - 4)} for w in (words, other)]
    true_jaccard = len(sh[0] & sh[1]) / len(sh[0] | sh[1])
    hashes, counts = minhash.shingle_hashes([" ".join(words), " ".join(other)], 5)
    sig = minhash.signatures(hashes, counts, a, b)
    estimate = minhash.estimated_jaccard(sig[:1], sig[1:])[0]
    assert abs(estimate - true_jaccard) < 4 * np.sqrt(true_jaccard * (1 - true_jaccard) / 256) + 1e-9


def test_signatures_are_multiply_add_modulo_2_32_minimised_per_document():
    a, b = minhash.permutations(8, seed=5)
    assert (a % 2 == 1).all() and a.dtype == b.dtype == np.uint32
    x = np.array([0, 1, 2**32 - 1, 123456789, 987654321], dtype=np.uint32)
    sig = minhash.signatures(x, np.array([2, 0, 3]), a, b)
    values = [[(int(ai) * int(xi) + int(bi)) % 2**32 for ai, bi in zip(a, b, strict=True)] for xi in x]
    assert sig[0].tolist() == np.minimum(values[0], values[1]).tolist()
    assert (sig[1] == minhash.EMPTY_SIGNATURE_VALUE).all()
    assert sig[2].tolist() == np.min(values[2:], axis=0).tolist()
    with pytest.raises(TypeError, match="must be uint32"):
        minhash.signatures(x.astype(np.uint64), np.array([5]), a, b)


def test_jaccard_estimates_have_the_spread_of_random_permutations():
    """Over 300 pairs of 300-shingle sets at Jaccard 0.5, each with its own seed, the estimates are unbiased
    and spread like a binomial over num_perm (the multiply-add family behaves as random permutations)."""
    rng = np.random.default_rng(0)
    num_perm, n, common = 100, 300, 200
    errors = []
    for seed in range(300):
        values = rng.integers(0, 2**32, size=2 * n - common, dtype=np.uint64).astype(np.uint32)
        pair = np.concatenate([values[:n], values[:common], values[n:]])
        a, b = minhash.permutations(num_perm, seed)
        sig = minhash.signatures(pair, np.array([n, n]), a, b)
        errors.append(minhash.estimated_jaccard(sig[:1], sig[1:])[0] - common / (2 * n - common))
    spread = np.sqrt(0.5 * 0.5 / num_perm)
    assert abs(np.mean(errors)) < 4 * spread / np.sqrt(len(errors))
    assert 0.85 * spread < np.std(errors) < 1.15 * spread


def test_s_curve_of_the_defaults():
    p = DedupParams()
    assert minhash.candidate_probability(0.8, p.bands, p.rows) > 0.999
    assert minhash.candidate_probability(0.3, p.bands, p.rows) < 0.05


def test_union_find_roots_are_smallest_members():
    uf = minhash.UnionFind(6)
    uf.union_pairs(np.array([4, 5, 1]), np.array([2, 4, 3]))
    assert uf.roots().tolist() == [0, 1, 2, 1, 2, 2]


def test_dedup_finds_exactly_the_planted_duplicates(corpus_ref, tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    ref = dedup.run(DedupParams(), [corpus_ref], store, map_shards=SERIAL)
    counts = ref.manifest()["counts"]
    n_docs = len(BASE) + len(EXACT_COPIES) + len(NEAR_COPIES)
    assert counts["docs_in"] == n_docs
    assert counts["docs_out"] == len(BASE)
    assert counts["dropped"] == {"exact": 3, "near": 4}
    assert counts["clusters"] == 6

    report = pq.read_table(ref.local_path("duplicates.parquet")).to_pylist()
    found = {r["id"]: (r["cluster"], r["kind"]) for r in report if not r["kept"]}
    planted = {k: (v, "exact") for k, v in EXACT_COPIES.items()} | {
        k: (v, "near") for k, v in NEAR_COPIES.items()
    }
    assert found == planted  # recall 1.0 and precision 1.0
    kept = {r["id"]: r["cluster_size"] for r in report if r["kept"]}
    assert kept == {
        "kjv-Ge-2": 2,
        "kjv-Ge-7": 3,
        "kjv-Ge-12": 2,
        "kjv-Ge-24": 2,
        "kjv-Ge-30": 2,
        "kjv-Ge-41": 2,
    }

    out_ids = [
        i for f in ref.files("shards/") for i in pq.read_table(ref.local_path(f)).column("id").to_pylist()
    ]
    assert out_ids == [d["id"] for d in BASE]  # first occurrences kept, order preserved

    again = dedup.run(DedupParams(), [corpus_ref], store, map_shards=SERIAL)
    assert again.cache_hit and again.key == ref.key == dedup.key(DedupParams(), [corpus_ref])


def test_exact_only_and_near_only(corpus_ref, tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    exact_only = dedup.run(DedupParams(near=False), [corpus_ref], store, map_shards=SERIAL)
    assert exact_only.manifest()["counts"]["dropped"] == {"exact": 3, "near": 0}
    near_only = dedup.run(DedupParams(exact=False), [corpus_ref], store, map_shards=SERIAL)
    # Exact copies are near duplicates too (Jaccard 1): still found, still reported as exact.
    assert near_only.manifest()["counts"]["dropped"] == {"exact": 3, "near": 4}


def test_verification_rejects_low_similarity_candidates(corpus_ref, tmp_path):
    # Single-word shingles, one row per band: nearly every pair of chapters shares a bucket.
    loose = {"shingle_size": 1, "num_perm": 64, "bands": 64, "rows": 1}
    ref = dedup.run(DedupParams(**loose), [corpus_ref], ArtifactStore(str(tmp_path / "a")), map_shards=SERIAL)
    counts = ref.manifest()["counts"]
    assert counts["candidate_pairs"] > 500
    assert counts["rejected_pairs"] == counts["candidate_pairs"] - 7  # only the planted pairs pass
    assert counts["dropped"] == {"exact": 3, "near": 4}
    unverified = dedup.run(
        DedupParams(**loose, verify=False),
        [corpus_ref],
        ArtifactStore(str(tmp_path / "b")),
        map_shards=SERIAL,
    )
    assert unverified.manifest()["counts"]["docs_out"] == 1  # everything merged into one cluster


def test_bucket_tasks_cut_the_corpus_by_band_and_hash_range():
    params = DedupParams()  # 20 LSH bands + the exact key, 65,536 keys per task
    assert dedup.bucket_tasks(params, 1000) == (1, [(list(range(21)), 0)])  # small corpus: one task
    ranges, tasks = dedup.bucket_tasks(params, 20_000)  # 3 bands per task
    assert ranges == 1 and [bands for bands, _ in tasks] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [9, 10, 11],
        [12, 13, 14],
        [15, 16, 17],
        [18, 19, 20],
    ]
    ranges, tasks = dedup.bucket_tasks(params, 1_000_000)  # one band per task, 16 hash ranges of ~62,500 docs
    assert ranges == 16 and len(tasks) == 21 * 16 and tasks[17] == ([1], 1)
    assert dedup.bucket_tasks(DedupParams(exact=False), 1_000_000)[1][-1] == ([19], 15)
    starts = dedup.hash_range_starts(4)
    assert starts.tolist() == [1 << 62, 2 << 62, 3 << 62]


def test_many_small_bucket_tasks_find_the_same_duplicates(corpus_ref, tmp_path):
    whole = dedup.run(DedupParams(), [corpus_ref], ArtifactStore(str(tmp_path / "a")), map_shards=SERIAL)
    # 57 documents, 8 per bucket task: 8 hash ranges x 21 bands, each task reads its slice of every shard.
    split_params = DedupParams(docs_per_bucket_task=8)
    split = dedup.run(split_params, [corpus_ref], ArtifactStore(str(tmp_path / "b")), map_shards=SERIAL)
    assert split.manifest()["lsh"]["hash_ranges"] == 8 and split.manifest()["lsh"]["bucket_tasks"] == 168
    assert len(split.files("pairs/")) == 168
    assert split.manifest()["counts"] == whole.manifest()["counts"]
    for name in [*whole.files("duplicates.parquet/"), *whole.files("shards/")]:
        assert Path(split.local_path(name)).read_bytes() == Path(whole.local_path(name)).read_bytes(), name


@pytest.mark.parametrize("url", ["local", "memory://ranges"])
def test_read_committed_npy_ranges(tmp_path, url):
    store = ArtifactStore(str(tmp_path / "store") if url == "local" else url)
    writer = store.begin("test", "key")
    array = np.arange(60, dtype=np.uint64).reshape(6, 10) * 3
    np.save(tmp_path / "a.npy", array)
    writer.commit_shard("a", {"a.npy": str(tmp_path / "a.npy")})
    got = read_committed_npy_ranges(writer, "a.npy", [12, 40, 59], [15, 40, 60])
    assert got.dtype == np.uint64 and got.tolist() == [36, 39, 42, 177]
    assert read_committed_npy_ranges(writer, "a.npy", [], []).tolist() == []
    writer.release(remove=True)


@pytest.mark.processes
def test_parallel_pool_gives_identical_bytes(corpus_ref, tmp_path):
    serial = dedup.run(DedupParams(), [corpus_ref], ArtifactStore(str(tmp_path / "a")), map_shards=SERIAL)
    pooled = dedup.run(
        DedupParams(), [corpus_ref], ArtifactStore(str(tmp_path / "b")), map_shards=process_pool(2)
    )
    assert _data_files(serial.url) == _data_files(pooled.url)


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError, match="bands x rows = 120 exceeds num_perm = 100"):
        DedupParams(bands=20, rows=6)
    with pytest.raises(ValueError, match="threshold"):
        DedupParams(threshold=1.5)


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    store = ArtifactStore(str(tmp_path / "store"))
    source = download.run(download.DownloadParams(source=str(tmp_path / "empty.jsonl")), [], store)
    ref = dedup.run(DedupParams(), [source], store, map_shards=SERIAL)
    counts = ref.manifest()["counts"]
    assert (counts["docs_in"], counts["docs_out"], counts["clusters"]) == (0, 0, 0)
    assert pq.read_table(ref.local_path("duplicates.parquet")).num_rows == 0


def _data_files(url: str) -> dict[str, bytes]:
    """Every output file except the manifest and the shard markers (which hold timestamps)."""
    root = Path(url)
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json" and "_shards" not in p.parts
    }


KILLER = """
import os, signal, sys
from storage.artifacts import ArtifactStore, ArtifactWriter
from stages import dedup
from stages.shards import process_pool

kill_after = int(sys.argv[3])
commit_shard = ArtifactWriter.commit_shard
def commit_then_die(self, name, files):
    commit_shard(self, name, files)
    global kill_after
    kill_after -= 1
    if kill_after == 0:
        os.kill(os.getpid(), signal.SIGKILL)
ArtifactWriter.commit_shard = commit_then_die
store = ArtifactStore(sys.argv[1])
source = store.ref({"stage": "download", "key": sys.argv[2], "url": sys.argv[4]})
params = dedup.DedupParams(docs_per_bucket_task=int(sys.argv[5]))
dedup.run(params, [source], store, map_shards=process_pool(1))
"""


# Tasks: 5 signature shards, then bucket tasks (1, or 42 with 32 documents per task), the cluster task, 5 kept shards.
@pytest.mark.processes
@pytest.mark.parametrize(
    "kill_after, docs_per_bucket_task",
    [(2, 1 << 16), (8, 32), (6, 1 << 16), (9, 1 << 16)],
    ids=["signatures", "buckets", "cluster", "kept-documents"],
)
def test_sigkill_then_rerun_is_byte_identical(corpus_ref, tmp_path, kill_after, docs_per_bucket_task):
    store_dir = tmp_path / "killed"
    store = ArtifactStore(str(store_dir))
    source = corpus_ref
    params = DedupParams(docs_per_bucket_task=docs_per_bucket_task)
    killer_args = [str(store_dir), source.key, str(kill_after), source.url, str(docs_per_bucket_task)]
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, *killer_args],
        cwd=ROOT,
        capture_output=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    key_dirs = list((store_dir / "dedup").iterdir())
    assert len(key_dirs) == 1 and not (key_dirs[0] / "manifest.json").exists()
    markers = {p.name: p.read_bytes() for p in (key_dirs[0] / "_shards").iterdir()}
    assert len(markers) == kill_after

    resumed = dedup.run(params, [source], store, map_shards=SERIAL)
    assert not resumed.cache_hit
    assert {p: (key_dirs[0] / "_shards" / p).read_bytes() for p in markers} == markers  # not redone
    clean = dedup.run(params, [source], ArtifactStore(str(tmp_path / "clean")), map_shards=SERIAL)
    assert resumed.key == clean.key
    assert _data_files(resumed.url) == _data_files(clean.url)
    assert resumed.manifest()["counts"] == clean.manifest()["counts"]


def test_near_duplicate_groups_join_each_document_with_its_near_copies_only() -> None:
    """Retro's held-out samples group documents so: 40 random documents, each with two copies of 1 word in 40
    changed (Jaccard about 0.8) -> 40 groups of three, the group named by its smallest index."""
    rng = random.Random(0)
    vocabulary = [f"w{i}" for i in range(5000)]
    originals = [[rng.choice(vocabulary) for _ in range(200)] for _ in range(40)]
    copies = [
        [f"edit{k}" if i % 40 == 7 + k else w for i, w in enumerate(words)]
        for k in (0, 1)
        for words in originals
    ]
    texts = [" ".join(words) for words in originals + copies]
    groups = minhash.near_duplicate_groups(texts, 0.5)
    np.testing.assert_array_equal(groups, np.tile(np.arange(40), 3))
    # at a higher threshold than their similarity the copies stay apart
    assert len(np.unique(minhash.near_duplicate_groups(texts, 0.95))) > 40
