"""Retro neighbours of the pretraining samples: documents of a sample, same-document exclusion, -1 padding, resume."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from megatron_train.data import DataConfig, build_train_valid_test_datasets
from retro.config import ChunkDatabaseConfig, IndexConfig, QueryConfig
from retro.db import build_chunk_database, document_key
from retro.index import add_to_index, load_index, train_index
from retro.query import (
    HeldOutSamples,
    exclude_own_documents,
    load_neighbours,
    query_pretraining_neighbours,
    sample_document_ids,
)
from stages.minhash import near_duplicate_groups
from tests.helpers.retro_corpus import (
    EOD,
    CountingEmbed,
    WordTokenizer,
    topic_documents,
    topic_embed,
    write_corpus,
)
from tests.helpers.wordpiece_corpus import build_tokenizer

SEQ_LENGTH, CHUNK_LENGTH = 32, 16


def test_sample_document_ids_are_the_documents_whose_tokens_the_sample_holds(tmp_path):
    rng = np.random.default_rng(0)  # no EOD: every token names its document
    lengths = rng.integers(1, 40, size=60)
    a = write_corpus(str(tmp_path / "a"), [[d + 2] * n for d, n in enumerate(lengths)])
    b = write_corpus(str(tmp_path / "b"), [[d + 1000] * n for d, n in enumerate(lengths[::-1])])
    data = DataConfig(data_path=["1", a, "1", b], split="80,20,0", data_cache_path=str(tmp_path / "cache"))
    train, valid, _ = build_train_valid_test_datasets(data, SEQ_LENGTH, (60, 10, 0), 1234, EOD)
    checked = 0
    for blend, first_token in ((train, (2, 1000)), (valid, (2, 1000))):
        for gpt, offset in zip(blend.datasets, first_token, strict=True):
            for idx in range(len(gpt)):
                tokens = gpt.sample_tokens(idx)
                from_tokens = np.unique(tokens[tokens >= 0]) - offset
                np.testing.assert_array_equal(sample_document_ids(gpt, idx), from_tokens)
                checked += 1
    assert checked > 60


def test_exclude_own_documents_keeps_order_and_pads():
    keys = document_key(np.array([0, 0, 1, 1, 0]), np.array([5, 6, 5, 7, 5]))
    found = np.array([[0, 2, 1, 3, 4], [4, -1, -1, -1, -1], [3, 1, 0, 2, 4]])
    banned = [
        document_key(0, np.array([5])),
        document_key(0, np.array([5])),
        document_key(1, np.array([5, 7])),
    ]
    np.testing.assert_array_equal(
        exclude_own_documents(found, keys, banned, 3), [[2, 1, 3], [-1, -1, -1], [1, 0, 4]]
    )


@pytest.fixture(scope="module")
def retro_setup(tmp_path_factory):
    """Database, filled IVF index and pretraining datasets of one topic corpus (split 80,20,0)."""
    tmp = tmp_path_factory.mktemp("retro_query")
    prefix = write_corpus(str(tmp / "corpus"), topic_documents(150, seed=5))
    db_config = ChunkDatabaseConfig(retro_gpt_chunk_length=CHUNK_LENGTH, retro_gpt_split="80,20,0")
    db = build_chunk_database([prefix], str(tmp / "db"), db_config, WordTokenizer(), build_tokenizer(tmp))
    index_config = IndexConfig(retro_index_str="IVF8,Flat", retro_index_ntrain=500, retro_block_size=1000)
    train_index(db, index_config, topic_embed, WordTokenizer(), str(tmp / "index"))
    path = add_to_index(db, index_config, topic_embed, WordTokenizer(), str(tmp / "index"))
    data = DataConfig(data_path=[prefix], split="80,20,0", data_cache_path=str(tmp / "cache"))
    datasets = build_train_valid_test_datasets(data, SEQ_LENGTH, (40, 10, 0), 1234, EOD)
    return db, load_index(path, 8, 64), datasets  # nprobe = all 8 lists: exact search


def _reference(
    db, datasets, split: int, num_query: int, num_save: int, held_out: HeldOutSamples | None = None
) -> tuple[np.ndarray, float]:
    """Exact search over every database chunk, then drop the sample's own documents (plain loops), and for a
    held-out sample every document of their groups; also the fraction of chunks whose nearest database chunk
    is from their own documents."""
    vectors = topic_embed(db.chunk_texts(range(len(db)), WordTokenizer()))
    exact = faiss.IndexFlatL2(vectors.shape[1])
    exact.add(vectors)
    dataset = datasets[split]
    rows, own_first = [], 0
    for sample in range(len(dataset)):
        tokens = dataset.sample_tokens(sample)
        docs = {(0, int(d)) for d in sample_document_ids(dataset, sample)}
        if held_out is not None and held_out.chosen(len(dataset))[sample]:
            groups = held_out.groups[0]
            docs = {(0, d) for d in range(len(groups)) if any(groups[d] == groups[own] for _, own in docs)}
        for position in range(SEQ_LENGTH // CHUNK_LENGTH):
            chunk = tokens[position * CHUNK_LENGTH : (position + 1) * CHUNK_LENGTH]
            text = WordTokenizer().detokenize(chunk[chunk >= 0].tolist())
            _, found = exact.search(topic_embed([text]), num_query)
            owners = [tuple(int(v) for v in db.chunks[i, :2]) for i in found[0]]
            own_first += owners[0] in docs
            kept = [int(i) for i, owner in zip(found[0], owners, strict=True) if owner not in docs][:num_save]
            rows.append(kept + [-1] * (num_save - len(kept)))
    return np.array(rows, dtype=np.int64), own_first / len(rows)


def test_neighbours_drop_the_samples_own_documents(retro_setup, tmp_path):
    db, index, datasets = retro_setup
    config = QueryConfig(
        retro_query_num_neighbors_query=20, retro_query_num_neighbors_save=5, retro_block_size=24
    )
    counts = query_pretraining_neighbours(
        datasets, db, index, topic_embed, WordTokenizer(), CHUNK_LENGTH, config, str(tmp_path)
    )
    train, valid, _ = datasets
    assert counts == {"train": 2 * len(train), "valid": 2 * len(valid)}  # 2 chunks a sample, one epoch each
    for split, name in ((0, "train"), (1, "valid")):
        neighbours = load_neighbours(str(tmp_path / name))
        expected, own_first = _reference(db, datasets, split, 20, 5)
        # Without the exclusion, half the train chunks would retrieve their own document first (measured
        # 0.54); validation documents are not in the database (it holds the train split's documents).
        assert own_first > 0.4 if name == "train" else own_first == 0.0
        np.testing.assert_array_equal(neighbours, expected)
        assert neighbours.shape == (counts[name], 5) and (neighbours >= 0).all()


def test_held_out_training_samples_also_drop_their_groups_documents(retro_setup, tmp_path):
    """Half the training samples are queried as held out: the documents of one topic form a near-duplicate
    group (word-set Jaccard >= 0.5), and a held-out sample's neighbours come from none of its group's documents;
    the other samples and the validation split are queried as before."""
    db, index, datasets = retro_setup
    config = QueryConfig(
        retro_query_num_neighbors_query=20, retro_query_num_neighbors_save=5, retro_block_size=24
    )
    corpus = db.datasets[0]
    texts = [WordTokenizer().detokenize(corpus.get(doc).tolist()) for doc in range(len(corpus))]
    groups = near_duplicate_groups(texts, 0.5, shingle_size=1)
    assert len(np.unique(groups)) < len(texts) / 5
    held_out = HeldOutSamples(0.5, seed=3, groups=[groups])
    query_pretraining_neighbours(
        datasets, db, index, topic_embed, WordTokenizer(), CHUNK_LENGTH, config, str(tmp_path), held_out
    )
    chosen = np.repeat(held_out.chosen(len(datasets[0])), SEQ_LENGTH // CHUNK_LENGTH)
    assert 0.3 < chosen.mean() < 0.7
    train = load_neighbours(str(tmp_path / "train"))
    np.testing.assert_array_equal(train, _reference(db, datasets, 0, 20, 5, held_out)[0])
    plain = _reference(db, datasets, 0, 20, 5)[0]
    np.testing.assert_array_equal(train[~chosen], plain[~chosen])
    assert (train[chosen] != plain[chosen]).any(axis=1).mean() > 0.5  # group mates were retrieved before
    np.testing.assert_array_equal(
        load_neighbours(str(tmp_path / "valid")), _reference(db, datasets, 1, 20, 5)[0]
    )
    with pytest.raises(ValueError, match="held_out_share"):
        query_pretraining_neighbours(
            datasets, db, index, topic_embed, WordTokenizer(), CHUNK_LENGTH, config, str(tmp_path),
            HeldOutSamples(0.25, seed=3, groups=held_out.groups),
        )  # fmt: skip


def test_neighbours_padding_and_resume(retro_setup, tmp_path):
    db, index, datasets = retro_setup
    config = QueryConfig(
        retro_query_num_neighbors_query=4, retro_query_num_neighbors_save=4, retro_block_size=24
    )
    crashing = CountingEmbed(fail_at=3)
    with pytest.raises(RuntimeError, match="crash"):
        query_pretraining_neighbours(
            datasets, db, index, crashing, WordTokenizer(), CHUNK_LENGTH, config, str(tmp_path)
        )
    resumed = CountingEmbed()
    query_pretraining_neighbours(
        datasets, db, index, resumed, WordTokenizer(), CHUNK_LENGTH, config, str(tmp_path)
    )
    train, valid, _ = datasets
    assert resumed.texts == 2 * len(train) - 2 * 24 + 2 * len(valid)  # all but the 2 committed blocks
    neighbours = load_neighbours(str(tmp_path / "train"))
    expected, _ = _reference(db, datasets, 0, 4, 4)
    np.testing.assert_array_equal(neighbours, expected)
    padded = neighbours == -1
    assert padded.any(axis=1).mean() > 0.5  # own-document neighbours removed, the rest padded with -1
    assert (np.sort(padded, axis=1) == padded).all()  # -1 only after the kept neighbours
