"""The Retro stages on a store: chained into a Retro project, cache hits on rerun, killed embed and index-add
resuming without redoing committed blocks, IVF recall against exact search on the embedded chunks."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import faiss
import numpy as np
import pytest

from megatron_train.tokenizer.train import train_byte_level_bpe
from retro.db import ChunkDatabase
from retro.index import ADDED_INDEX
from retro.project import RetroProject, db_dir, index_path
from retro.query import load_neighbours
from stages import retro_db, retro_embed, retro_index_add, retro_index_train, retro_query, tokenize
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
from storage.artifacts import ArtifactStore
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


def run_all(setup: Setup, store: ArtifactStore) -> dict:
    refs = {"db": retro_db.run(db_params(setup), [setup.tokenize], store)}
    refs["embed"] = retro_embed.run(embed_params(setup), [setup.tokenize, refs["db"]], store)
    train = IndexTrainParams(index_str="IVF16,Flat", ntrain=800)
    refs["train"] = retro_index_train.run(train, [refs["db"], refs["embed"]], store)
    refs["add"] = retro_index_add.run(IndexAddParams(workers=1), [refs["embed"], refs["train"]], store)
    query = QueryParams(**setup.gpt, embedder=setup.embedder, **QUERY)
    refs["query"] = retro_query.run(query, [setup.tokenize, refs["db"], refs["add"]], store)
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
