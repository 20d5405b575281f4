"""Retro faiss index: training sample, recall against exact search, search parameters, resumable fill."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import faiss
import numpy as np
import pytest

from retro.config import ChunkDatabaseConfig, IndexConfig, QueryConfig
from retro.db import ChunkDatabase, build_chunk_database
from retro.index import add_to_index, load_index, set_search_parameters, train_index, training_chunk_ids
from tests.helpers.retro_corpus import (
    INDEX_CONFIG,
    CountingEmbed,
    WordTokenizer,
    topic_documents,
    topic_embed,
    write_corpus,
)
from tests.helpers.wordpiece_corpus import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DB_CONFIG = ChunkDatabaseConfig(
    retro_gpt_chunk_length=16, retro_doc_block_size=100, retro_gpt_split="90,10,0"
)
QUERY_CONFIG = QueryConfig(retro_query_nprobe=4, retro_query_ef_search=64)


@pytest.fixture(scope="module")
def database(tmp_path_factory) -> ChunkDatabase:
    """Two blended datasets of topic documents: about 2,300 chunks."""
    tmp = tmp_path_factory.mktemp("retro_index")
    a = write_corpus(str(tmp / "a"), topic_documents(200, seed=0))
    b = write_corpus(str(tmp / "b"), topic_documents(100, seed=0, min_length=100))
    return build_chunk_database(
        ["3", a, "1", b], str(tmp / "db"), DB_CONFIG, WordTokenizer(), build_tokenizer(tmp)
    )


def test_training_sample_follows_blend_weights_and_load_fraction(database):
    n0 = database.infos[0].n_chunks_train
    ids = training_chunk_ids(database, IndexConfig(retro_index_ntrain=800))
    assert len(ids) == 800 and len(np.unique(ids)) == 800
    assert ((ids < n0).sum(), (ids >= n0).sum()) == (600, 200)  # weights 3:1
    assert ids.max() < len(database)
    np.testing.assert_array_equal(ids, training_chunk_ids(database, IndexConfig(retro_index_ntrain=800)))
    half = training_chunk_ids(
        database, IndexConfig(retro_index_ntrain=800, retro_index_train_load_fraction=0.5)
    )
    assert ((half < n0).sum(), (half >= n0).sum()) == (300, 100)
    assert set(half) <= set(ids)
    with pytest.raises(ValueError, match="lower --retro-index-ntrain"):
        training_chunk_ids(database, IndexConfig(retro_index_ntrain=100 * len(database)))


def test_ivf_recall_at_10_against_exact_search(database, tmp_path):
    embed = CountingEmbed()
    train_index(database, INDEX_CONFIG, embed, WordTokenizer(), str(tmp_path))
    assert embed.texts == INDEX_CONFIG.retro_index_ntrain
    path = add_to_index(database, INDEX_CONFIG, embed, WordTokenizer(), str(tmp_path))
    index = load_index(path, QUERY_CONFIG.retro_query_nprobe, QUERY_CONFIG.retro_query_ef_search)
    assert index.ntotal == len(database)

    vectors = topic_embed(database.chunk_texts(range(len(database)), WordTokenizer()))
    exact = faiss.IndexFlatL2(vectors.shape[1])
    exact.add(vectors)
    rng = np.random.default_rng(0)
    queries = vectors[rng.choice(len(vectors), 300, replace=False)]
    queries += 0.05 * rng.standard_normal(queries.shape).astype(np.float32)
    _, truth = exact.search(queries, 10)

    def recall(nprobe: int) -> float:
        set_search_parameters(index, nprobe, 64)
        _, found = index.search(queries, 10)
        return np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth, strict=True)])

    assert recall(QUERY_CONFIG.retro_query_nprobe) >= 0.9  # measured 0.997 (nprobe 1: 0.86)
    assert recall(1) < recall(4)
    assert recall(16) == 1.0  # every list visited: exact
    assert faiss.extract_index_ivf(index).nprobe == 16
    set_search_parameters(index, 65536, 64)  # Megatron's default nprobe is capped at the list count
    assert faiss.extract_index_ivf(index).nprobe == 16


def test_killed_fill_resumes_without_recomputing_committed_blocks(database, tmp_path):
    train_index(database, INDEX_CONFIG, topic_embed, WordTokenizer(), str(tmp_path / "clean"))
    shutil.copytree(tmp_path / "clean", tmp_path / "resumed")
    clean = add_to_index(database, INDEX_CONFIG, topic_embed, WordTokenizer(), str(tmp_path / "clean"))

    crashing = CountingEmbed(fail_at=3)
    with pytest.raises(RuntimeError, match="crash"):
        add_to_index(database, INDEX_CONFIG, crashing, WordTokenizer(), str(tmp_path / "resumed"))
    assert len(os.listdir(tmp_path / "resumed" / "codes")) == 2
    assert not (tmp_path / "resumed" / "added.faissindex").exists()
    resumed = CountingEmbed()
    path = add_to_index(database, INDEX_CONFIG, resumed, WordTokenizer(), str(tmp_path / "resumed"))
    assert resumed.texts == len(database) - 2 * INDEX_CONFIG.retro_block_size
    with open(clean, "rb") as a, open(path, "rb") as b:
        assert a.read() == b.read()
    again = CountingEmbed()
    add_to_index(database, INDEX_CONFIG, again, WordTokenizer(), str(tmp_path / "resumed"))
    assert again.calls == 0  # a filled index is reused as is


def test_opq_ivf_hnsw_pq_index_and_ef_search(database, tmp_path):
    config = IndexConfig(
        retro_index_str="OPQ8_32,IVF16_HNSW8,PQ8x4", retro_index_ntrain=1200, retro_block_size=1000
    )
    train_index(database, config, topic_embed, WordTokenizer(), str(tmp_path))
    index = load_index(add_to_index(database, config, topic_embed, WordTokenizer(), str(tmp_path)), 8, 48)
    ivf = faiss.extract_index_ivf(index)
    assert (index.ntotal, ivf.nprobe, faiss.downcast_index(ivf.quantizer).hnsw.efSearch) == (
        len(database),
        8,
        48,
    )
    vectors = topic_embed(database.chunk_texts(range(20), WordTokenizer()))
    _, found = index.search(vectors, 5)
    assert np.mean([i in row for i, row in enumerate(found)]) >= 0.9  # each chunk finds itself


def test_index_without_standalone_codes_is_refused(database, tmp_path):
    config = IndexConfig(retro_index_str="HNSW8", retro_index_ntrain=100)
    train_index(database, config, topic_embed, WordTokenizer(), str(tmp_path))
    with pytest.raises(ValueError, match="use an IVF index"):
        add_to_index(database, config, topic_embed, WordTokenizer(), str(tmp_path))


@pytest.mark.processes
def test_sigkilled_fill_resumes_to_identical_index(database, tmp_path):
    train_index(database, INDEX_CONFIG, topic_embed, WordTokenizer(), str(tmp_path / "clean"))
    shutil.copytree(tmp_path / "clean", tmp_path / "resumed")
    clean = add_to_index(database, INDEX_CONFIG, topic_embed, WordTokenizer(), str(tmp_path / "clean"))
    script = textwrap.dedent(
        f"""
        from retro.db import ChunkDatabase
        from retro.index import add_to_index
        from tests.helpers.retro_corpus import WordTokenizer
        from tests.helpers.retro_corpus import INDEX_CONFIG, CountingEmbed
        db = ChunkDatabase({database.db_dir!r})
        add_to_index(db, INDEX_CONFIG, CountingEmbed(fail_at=4, kill=True), WordTokenizer(), {str(tmp_path / "resumed")!r})
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": REPO},
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()
    assert len(os.listdir(tmp_path / "resumed" / "codes")) == 3
    resumed = CountingEmbed()
    path = add_to_index(database, INDEX_CONFIG, resumed, WordTokenizer(), str(tmp_path / "resumed"))
    assert resumed.texts == len(database) - 3 * INDEX_CONFIG.retro_block_size
    with open(clean, "rb") as a, open(path, "rb") as b:
        assert a.read() == b.read()


def test_training_clusters_on_gpu_when_faiss_sees_one(database, tmp_path, monkeypatch):
    """With a GPU, the IVF k-means runs on a GPU flat index (faiss-gpu is not installed here: stand-in)."""
    moved = []

    def to_gpus(index):
        moved.append(index)
        return index  # the CPU index stands in for its GPU copy

    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", to_gpus)
    path = train_index(database, INDEX_CONFIG, topic_embed, WordTokenizer(), str(tmp_path))
    assert [(type(index).__name__, index.d, index.ntotal) for index in moved] == [("IndexFlatL2", 32, 16)]
    assert faiss.read_index(path).is_trained
