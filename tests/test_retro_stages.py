"""The Retro stages on a store: chained into a Retro project, cache hits on rerun, killed embed and index-add
resuming without redoing committed blocks, IVF recall against exact search on the embedded chunks."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import faiss
import numpy as np
import pytest

from megatron_train.tokenizer.train import train_byte_level_bpe
from retro.db import ChunkDatabase
from retro.index import ADDED_INDEX
from retro.project import RetroProject, db_dir, index_path
from retro.query import load_neighbours
from stages import download, retro_db, retro_embed, retro_index_add, retro_index_train, retro_query, tokenize
from stages.retro_embed import embedding_blocks, load_embeddings
from stages.retro_params import (
    DbParams,
    EmbedParams,
    IndexAddParams,
    IndexTrainParams,
    QueryParams,
    local_dir,
)
from stages.tokenize_params import TokenizeParams
from storage.artifacts import ArtifactStore, CachePolicy
from storage.verify import ChangedArtifactError
from tests.helpers.retro_corpus import topic_texts, write_tiny_embedder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK_LENGTH = 16
BLOCK_SIZE = 200  # chunks per embedding block: about 8 blocks


@dataclasses.dataclass
class Setup:
    store: ArtifactStore
    tokenize: object
    gpt: dict
    embedder: str


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    tmp = tmp_path_factory.mktemp("retro_stages")
    texts = topic_texts(250, seed=3)
    files = train_byte_level_bpe(texts, str(tmp / "bpe"), vocab_size=400)
    gpt = {"gpt_vocab_file": files["vocab_file"], "gpt_merge_file": files["merge_file"]}
    source = tmp / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    store = ArtifactStore(str(tmp / "store"))
    params = TokenizeParams(
        vocab_file=gpt["gpt_vocab_file"], merge_file=gpt["gpt_merge_file"], append_eod=True, workers=1
    )
    ref = tokenize.run(params, str(source), store)
    return Setup(store, ref, gpt, write_tiny_embedder(str(tmp / "embedder")))


def db_params(setup: Setup) -> DbParams:
    return DbParams(**setup.gpt, embedder=setup.embedder, chunk_length=CHUNK_LENGTH, split="90,10,0")


def embed_params(setup: Setup) -> EmbedParams:
    return EmbedParams(**setup.gpt, embedder=setup.embedder, block_size=BLOCK_SIZE, workers=1)


QUERY = dict(
    seq_length=32, split="90,10,0", train_samples=64, eval_interval=4, eval_iters=1, global_batch_size=8
)
QUERY |= dict(nprobe=4, num_neighbors_query=20, num_neighbors_save=3, block_size=100)


def run_all(setup: Setup, store: ArtifactStore, tokenized: object | None = None) -> dict:
    """The Retro stages on `tokenized` (default the setup's corpus) in `store`."""
    tokenized = tokenized or setup.tokenize
    refs = {"db": retro_db.run(db_params(setup), [tokenized], store)}
    refs["embed"] = retro_embed.run(embed_params(setup), [tokenized, refs["db"]], store)
    train = IndexTrainParams(index_str="IVF16,Flat", ntrain=800)
    refs["train"] = retro_index_train.run(train, [refs["db"], refs["embed"]], store)
    refs["add"] = retro_index_add.run(IndexAddParams(workers=1), [refs["embed"], refs["train"]], store)
    query = QueryParams(**setup.gpt, embedder=setup.embedder, **QUERY)
    refs["query"] = retro_query.run(query, [tokenized, refs["db"], refs["add"]], store)
    return refs


def test_stages_build_a_retro_project_and_rerun_is_all_cache_hits(setup):
    refs = run_all(setup, setup.store)
    assert not any(ref.cache_hit for ref in refs.values())
    project_dir = os.path.dirname(refs["query"].local_path("config.json"))
    project = RetroProject.load(project_dir)
    assert project.retro_gpt_chunk_length == CHUNK_LENGTH and project.retro_gpt_seq_length == 32
    assert project.retro_neighbor_dirs == {"train": "train", "valid": "valid", "test": None}
    # The project's database reads its own copy of the data (a relative prefix) and matches the store's.
    db = ChunkDatabase(db_dir(project_dir))
    assert db.prefixes == [os.path.join(project_dir, "data", "corpus")]
    assert len(db) == refs["embed"].manifest()["summary"]["chunks"] > 1000
    tokens = db.chunk_tokens(len(db) - 1)
    assert 0 < len(tokens) <= CHUNK_LENGTH
    train_samples, valid_samples, _ = project.num_samples()
    for split, samples in (("train", train_samples), ("valid", valid_samples)):
        neighbours = load_neighbours(project.neighbor_dir(project_dir, split))
        # 2 chunks per 32-token sample (whole epochs: at least the samples asked), 3 neighbours saved
        assert (
            neighbours.shape[0] >= samples * 2 and neighbours.shape[0] % 2 == 0 and neighbours.shape[1] == 3
        )
        assert neighbours.max() < len(db) and (neighbours >= 0).mean() > 0.9
    assert faiss.read_index(index_path(project_dir)).ntotal == len(db)
    again = run_all(setup, setup.store)
    assert all(ref.cache_hit for ref in again.values())
    assert {name: ref.url for name, ref in again.items()} == {name: ref.url for name, ref in refs.items()}


def test_held_out_training_samples_change_the_train_neighbours_only(setup, tmp_path):
    """held_out_share: a share of the training samples queried as held-out documents is another artifact. On a
    corpus of documents and their near-copies (one word in thirty changed), those samples no longer retrieve their
    copy's chunks; the validation neighbours are the plain query's, and a query without held-out samples keeps
    the key it had before the option existed."""
    texts = topic_texts(120, seed=4)
    words = [text.split() for text in texts]
    copies = [" ".join("edited" if i % 30 == 15 else w for i, w in enumerate(doc)) for doc in words]
    source = tmp_path / "docs.jsonl"
    source.write_text(
        "".join(json.dumps({"text": t}) + "\n" for pair in zip(texts, copies, strict=True) for t in pair)
    )
    store = ArtifactStore(str(tmp_path / "store"))
    vocab, merges = setup.gpt["gpt_vocab_file"], setup.gpt["gpt_merge_file"]
    params = TokenizeParams(vocab_file=vocab, merge_file=merges, append_eod=True, workers=1)
    tokenized = tokenize.run(params, str(source), store)
    refs = run_all(setup, store, tokenized)
    plain = QueryParams(**setup.gpt, embedder=setup.embedder, **QUERY)
    assert "held_out_share" not in plain.key_fields()
    held = QueryParams(**setup.gpt, embedder=setup.embedder, **QUERY, held_out_share=0.5)
    ref = retro_query.run(held, [tokenized, refs["db"], refs["add"]], store)
    assert not ref.cache_hit and ref.url != refs["query"].url
    neighbours = {}
    for name, artifact in (("plain", refs["query"]), ("held", ref)):
        project_dir = os.path.dirname(artifact.local_path("config.json"))
        project = RetroProject.load(project_dir)
        neighbours[name] = {
            split: load_neighbours(project.neighbor_dir(project_dir, split)) for split in ("train", "valid")
        }
    np.testing.assert_array_equal(neighbours["held"]["valid"], neighbours["plain"]["valid"])
    changed = (neighbours["held"]["train"] != neighbours["plain"]["train"]).any(axis=1)
    assert 0.2 < changed.mean() < 0.8, changed.mean()
    for field, value in (("held_out_share", 1.5), ("held_out_jaccard", 0.0)):
        with pytest.raises(ValueError, match=f"^{field} must be in"):
            QueryParams(**setup.gpt, embedder=setup.embedder, **{**QUERY, field: value})


def test_ivf_recall_at_10_against_exact_search_on_the_chunk_embeddings(setup):
    refs = run_all(setup, setup.store)
    total = refs["embed"].manifest()["summary"]["chunks"]
    vectors = load_embeddings(refs["embed"], np.arange(total))
    index = faiss.read_index(refs["add"].local_path(ADDED_INDEX))
    faiss.extract_index_ivf(index).nprobe = QUERY["nprobe"]
    exact = faiss.IndexFlatL2(vectors.shape[1])
    exact.add(vectors)
    queries = vectors[:: max(1, total // 300)]
    found, truth = index.search(queries, 10)[1], exact.search(queries, 10)[1]
    recall = np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth, strict=True)])
    assert recall >= 0.9, recall


class Counter:
    """Counts the blocks a stage's worker does; SIGKILLs its own process at block `kill_at`."""

    def __init__(self, kill_at: int | None) -> None:
        self.kill_at, self.blocks = kill_at, 0

    def tick(self) -> None:
        self.blocks += 1
        if self.blocks == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def counting_embedders(counter: Counter):
    """`retro_embed.worker_embedder` whose embedders tick `counter` once per block."""
    real = retro_embed.worker_embedder

    def worker_embedder(*args):
        embed = real(*args)

        def counted(texts):
            counter.tick()
            return embed(texts)

        return counted

    return worker_embedder


def counting_indexes(counter: Counter):
    """`retro_index_add.worker_index` whose indexes tick `counter` once per encoded block."""
    real = retro_index_add.worker_index

    class Counted:
        def __init__(self, index) -> None:
            self.index = index

        def sa_encode(self, vectors):
            counter.tick()
            return self.index.sa_encode(vectors)

    return lambda path: Counted(real(path))


def run_resumable_stage(spec: dict, counter: Counter) -> object:
    """Run the embed or index-add stage of `spec` into `spec["store"]`, its worker counting blocks (in-process:
    one worker)."""
    store, refs = (
        ArtifactStore(spec["store"]),
        {name: ArtifactStore(spec["inputs"]).ref(ref) for name, ref in spec["refs"].items()},
    )
    setup = Setup(store, refs["tokenize"], spec["gpt"], spec["embedder"])
    if spec["stage"] == "embed":
        retro_embed.worker_embedder = counting_embedders(counter)
        return retro_embed.run(embed_params(setup), [refs["tokenize"], refs["db"]], store)
    retro_index_add.worker_index = counting_indexes(counter)
    return retro_index_add.run(IndexAddParams(workers=1), [refs["embed"], refs["train"]], store)


KILLED_RUN = textwrap.dedent(
    """
    import json, sys
    from tests.test_retro_stages import Counter, run_resumable_stage
    run_resumable_stage(json.loads(sys.argv[1]), Counter(kill_at=3))
    """
)


@pytest.mark.processes
@pytest.mark.parametrize("stage", ["embed", "add"])
def test_a_killed_stage_resumes_without_redoing_committed_blocks(setup, tmp_path, monkeypatch, stage):
    refs = run_all(setup, setup.store)
    spec = {
        "stage": stage,
        "store": str(tmp_path / "store"),
        "inputs": setup.store.url,
        "refs": {name: ref.to_dict() for name, ref in {"tokenize": setup.tokenize, **refs}.items()},
        "gpt": setup.gpt,
        "embedder": setup.embedder,
    }
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, json.dumps(spec)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # run_resumable_stage swaps the worker functions: monkeypatch puts them back after the test
    monkeypatch.setattr(retro_embed, "worker_embedder", retro_embed.worker_embedder)
    monkeypatch.setattr(retro_index_add, "worker_index", retro_index_add.worker_index)
    counter = Counter(kill_at=None)
    resumed = run_resumable_stage(spec, counter)
    blocks = len(embedding_blocks(refs["embed"]))
    assert blocks >= 6 and counter.blocks == blocks - 2  # the two blocks committed before the kill are kept
    reference = refs["embed" if stage == "embed" else "add"]
    assert resumed.manifest()["files"] == reference.manifest()["files"]  # same bytes as the uninterrupted run


def test_an_object_store_gives_the_same_neighbours(setup, tmp_path, monkeypatch):
    """The stages on a `memory://` store (files reach them as cached local copies) write the local store's
    neighbours."""
    monkeypatch.setenv("MEGATRON_FLOW_CACHE", str(tmp_path / "cache"))
    local = run_all(setup, setup.store)["query"]
    remote = run_all(setup, ArtifactStore(f"memory://retro-{uuid.uuid4().hex}"))["query"]
    assert remote.url.startswith("memory://") and not remote.cache_hit
    neighbours = {name: info for name, info in local.manifest()["files"].items() if name.endswith(".npy")}
    assert neighbours and {name: remote.manifest()["files"][name] for name in neighbours} == neighbours
    project = local_dir(remote)  # the whole project, downloaded
    np.testing.assert_array_equal(
        load_neighbours(os.path.join(project, "query", "train")),
        load_neighbours(os.path.join(local_dir(local), "query", "train")),
    )


def _copy_of_store(setup: Setup, tmp_path) -> tuple[ArtifactStore, dict]:
    """Every Retro artifact in a copy of the module's store (hard links kept: the project's index is the
    index-add artifact's file), to damage without touching the other tests' store."""
    refs = {"tokenize": setup.tokenize, **run_all(setup, setup.store)}
    subprocess.run(["cp", "-a", setup.store.root, str(tmp_path / "store")], check=True)
    store = ArtifactStore(str(tmp_path / "store"))
    return store, {name: store.find(ref.stage, ref.key) for name, ref in refs.items()}


def _overwrite(path: Path, data: bytes) -> None:
    """What a user (or a bug) does to a committed, read-only file: make it writable, then write it."""
    path.chmod(0o644)
    path.write_bytes(data)


def _project_files(ref) -> dict[str, bytes]:
    return {name: Path(ref.local_path(name)).read_bytes() for name in ref.files()}


@pytest.mark.processes
def test_a_changed_retro_index_is_refused_and_rebuild_recovers_it(setup, tmp_path):
    store, refs = _copy_of_store(setup, tmp_path)
    rebuild = store.with_policy(CachePolicy(rebuild=True))
    query = QueryParams(**setup.gpt, embedder=setup.embedder, **QUERY)
    # The project records the store's folder (settings.json): its bytes in this copy are those of a rebuild here.
    refs["query"] = retro_query.run(query, [refs["tokenize"], refs["db"], refs["add"]], rebuild)
    added = Path(refs["add"].local_path(ADDED_INDEX))
    linked = Path(refs["query"].local_path("index/added.faissindex"))
    assert added.stat().st_ino == linked.stat().st_ino and stat.S_IMODE(added.stat().st_mode) == 0o444
    index_bytes, project = added.read_bytes(), _project_files(refs["query"])
    changed = bytearray(index_bytes)
    changed[len(changed) // 2] ^= 0x5A
    _overwrite(added, bytes(changed))

    # The query stage (another setting: it must build) refuses before reading the index: no crash, no manifest.
    other = QueryParams(**setup.gpt, embedder=setup.embedder, **{**QUERY, "num_neighbors_save": 2})
    inputs = [refs["tokenize"], refs["db"], refs["add"]]
    with pytest.raises(ChangedArtifactError) as refused:
        retro_query.run(other, inputs, store)
    assert str(refused.value) == (
        f"{added}: its content differs from its manifest's hash; the retro_index_add artifact {refs['add'].url} "
        "changed after it was committed: rebuild it (--rebuild retro_index_add)"
    )
    assert store.find("retro_query", retro_query.key(other, inputs)) is None
    # The project's hard link changed with it: what reads the project (Retro pretraining) refuses as well.
    with pytest.raises(ChangedArtifactError, match=f"^{linked}: its content differs"):
        refs["query"].verify()

    # --rebuild retro_index_add, and with it the stage after it: the same bytes as before the damage.
    add = retro_index_add.run(IndexAddParams(workers=1), [refs["embed"], refs["train"]], rebuild)
    project_ref = retro_query.run(query, [refs["tokenize"], refs["db"], add], rebuild)
    assert (add.key, project_ref.key) == (refs["add"].key, refs["query"].key) and add.rebuilt
    assert Path(add.local_path(ADDED_INDEX)).read_bytes() == index_bytes
    assert _project_files(project_ref) == project
    project_ref.verify()


@pytest.mark.processes
def test_random_byte_flips_in_every_kind_of_committed_file_are_refused(setup, tmp_path):
    """Fuzz: each kind of file the stages commit (Parquet shards, token data, NumPy arrays, JSON, faiss indexes,
    safetensors, vocabularies), a random byte changed: verification names it, every time; the manifest itself
    is refused or reads the same (a blank changed into another blank)."""
    store, refs = _copy_of_store(setup, tmp_path)
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in topic_texts(20, seed=5)))
    refs["download"] = download.run(download.DownloadParams(source=str(source), docs_per_shard=10), [], store)
    kinds: dict[str, tuple] = {}
    for ref in refs.values():
        for name in ref.files():
            kinds.setdefault(Path(name).suffix, (ref, name))
    assert {".parquet", ".bin", ".idx", ".npy", ".json", ".faissindex", ".safetensors", ".txt"} <= set(kinds)
    rng = random.Random(0)
    for ref, name in kinds.values():
        path = Path(ref.local_path(name))
        original = path.read_bytes()
        for _ in range(10):
            data = bytearray(original)
            data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
            _overwrite(path, bytes(data))
            with pytest.raises(ChangedArtifactError) as refused:
                ref.verify()
            assert str(refused.value).startswith(f"{path}: its content differs from its manifest's hash; "), (
                name
            )
        _overwrite(path, original)
        ref.verify()
    for ref in refs.values():
        path = Path(ref.local_path("manifest.json"))
        original, fields = path.read_bytes(), ref.manifest()
        for _ in range(10):
            data = bytearray(original)
            data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
            _overwrite(path, bytes(data))
            try:
                assert ref.manifest() == fields
            except ChangedArtifactError as refused:
                assert str(refused).startswith(f"{ref.url}/manifest.json: ")
        _overwrite(path, original)
