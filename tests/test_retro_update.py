"""The database update (`retro.update`): held-out documents enter the database and index without rebuilding
them, and only the new chunks are embedded and only the held-out samples' chunks queried."""

from __future__ import annotations

import os

import faiss
import numpy as np
import pytest

from megatron_train.data import DataConfig, build_train_valid_test_datasets
from megatron_train.data.retro_dataset import RetroDataset
from megatron_train.tokenizer.bert import BertWordPieceTokenizer
from megatron_train.tokenizer.null import NullTokenizer
from retro.db import ChunkDatabase, document_chunk_bounds
from retro.project import RetroProject, db_dir
from retro.update import update_database
from stages.retro_evaluate import SwappedNeighbours
from tests.helpers.retro_project import (
    CHUNK_LENGTH,
    EMBED_DIM,
    EOD,
    SEQ_LENGTH,
    VOCAB_SIZE,
    bag_of_tokens,
    build_project,
    twin_documents,
)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("retro_update"))
    build_project(directory, twin_documents(60), train_samples=32, global_batch_size=4, split="80,20,0")
    return directory


class CountingEmbed:
    """`bag_of_tokens`, recording how many texts each call embeds."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.calls.append(len(texts))
        return bag_of_tokens(texts)


def test_the_update_embeds_only_the_new_chunks_and_requeries_only_the_held_out_samples(project):
    config = RetroProject.load(project)
    datasets = build_train_valid_test_datasets(
        DataConfig(data_path=config.data_path(project), split=config.retro_gpt_split,
                   data_cache_path=os.path.join(project, "cache")),
        SEQ_LENGTH, config.num_samples(), config.retro_gpt_seed, EOD, VOCAB_SIZE + 1,
    )  # fmt: skip
    valid = datasets[1]
    db = ChunkDatabase(db_dir(project))
    gpt_tokenizer = NullTokenizer(VOCAB_SIZE)
    index = faiss.IndexIDMap(faiss.IndexFlatL2(EMBED_DIM))  # ids = chunk ids, as the filled IVF index
    index.add_with_ids(bag_of_tokens(db.chunk_texts(range(len(db)), gpt_tokenizer)), np.arange(len(db)))
    held_out = np.unique(valid.document_index)
    assert not np.isin(held_out, db.chunks[:, 1]).any()  # the database holds train documents only
    expected_chunks = sum(
        len(document_chunk_bounds(db.datasets[0].get(int(doc)), EOD, CHUNK_LENGTH)) for doc in held_out
    )
    embed, samples = CountingEmbed(), 5
    before = len(db)

    update = update_database(
        valid, samples, db, index, embed, gpt_tokenizer,
        BertWordPieceTokenizer(os.path.join(project, config.retro_bert_vocab_file)), CHUNK_LENGTH, 2,
    )  # fmt: skip

    chunks_per_sample = SEQ_LENGTH // CHUNK_LENGTH
    assert (update.added_documents, update.added_chunks) == (len(held_out), expected_chunks)
    assert update.queried_chunks == samples * chunks_per_sample
    assert embed.calls == [expected_chunks, samples * chunks_per_sample]  # nothing old re-embedded
    assert len(db) == before and len(update.db) == before + expected_chunks and index.ntotal == len(update.db)
    assert set(np.unique(update.db.chunks[before:, 1])) == set(held_out.tolist())
    assert update.neighbours.shape == (samples * chunks_per_sample, 2)
    new = update.neighbours[update.neighbours >= before]
    assert new.size > 0  # the held-out samples now retrieve their own documents' chunks
    # The Retro dataset reads the new chunks' tokens from the corpus like any other chunk.
    retro = RetroDataset(valid, update.neighbours, update.db, SEQ_LENGTH, CHUNK_LENGTH, 2, 1, EOD,
                         verify_neighbor_count=False)  # fmt: skip
    row = int(np.argwhere(update.neighbours[:chunks_per_sample] >= before)[0][0])
    column = int(np.argwhere(update.neighbours[row] >= before)[0][0])
    chunk = update.db.chunk_tokens(int(update.neighbours[row, column]))
    np.testing.assert_array_equal(retro[0]["neighbor_tokens"][row, column, : len(chunk)], chunk)


def test_swapped_neighbours_are_the_next_samples_or_none():
    samples = [{"tokens": np.full(4, i), "neighbor_tokens": np.full((1, 1, 8), 10 + i)} for i in range(4)]

    class Listed(RetroDataset):  # only indexing and the EOD id are read
        def __init__(self) -> None:
            self.eod = EOD

        def __getitem__(self, index: int) -> dict[str, np.ndarray]:
            return samples[index]

    other = SwappedNeighbours(Listed(), 3, "next")  # the first 3 samples, wrapping
    assert len(other) == 3
    assert [(int(other[i]["tokens"][0]), int(other[i]["neighbor_tokens"][0, 0, 0])) for i in range(3)] == [
        (0, 11), (1, 12), (2, 10),
    ]  # fmt: skip
    none = SwappedNeighbours(Listed(), 3, "none")
    assert (none[1]["neighbor_tokens"] == EOD).all() and int(none[1]["tokens"][0]) == 1
    with pytest.raises(ValueError, match="swap must be 'next' or 'none'"):
        SwappedNeighbours(Listed(), 3, "shuffled")
