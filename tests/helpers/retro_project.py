"""A small Retro project directory for the Retro model tests, built with the real preprocessing steps.

The GPT data is NullTokenizer ids (--vocab-size 127, EOD 127); documents come in identical pairs of random
tokens, so a chunk's nearest other-document neighbour is its twin and the twin's continuation holds the
tokens that follow: Retro can copy them, a GPT cannot predict them. The index is exact (`IndexFlatL2`) over a
bag-of-tokens embedding, saved where generation with retrieval reads it; the chunk database, neighbour query
and config.json are `retro.db`, `retro.query` and `retro.project` (docs/architecture.md, Retro preprocessing).
"""

from __future__ import annotations

import os

import faiss
import numpy as np

from megatron_train.data import DataConfig, build_train_valid_test_datasets
from megatron_train.tokenizer.bert import BertWordPieceTokenizer
from megatron_train.tokenizer.null import NullTokenizer
from retro.config import ChunkDatabaseConfig, QueryConfig
from retro.db import build_chunk_database
from retro.project import DATA_DIR, RetroProject, db_dir, index_path
from retro.query import query_pretraining_neighbours
from storage.atomic import atomic_path
from tests.helpers.retro_corpus import write_corpus
from tests.helpers.wordpiece_corpus import write_vocab

VOCAB_SIZE, EOD = 127, 127
SEQ_LENGTH, CHUNK_LENGTH = 16, 4
NUM_SAVED_NEIGHBOURS = 3
EMBED_DIM = 64


def twin_documents(
    num_pairs: int, seed: int = 0, min_length: int = 6, max_length: int = 30
) -> list[np.ndarray]:
    """Pairs of identical documents of random tokens (each ending with EOD), the pairs shuffled."""
    rng = np.random.default_rng(seed)
    documents = []
    for _ in range(num_pairs):
        tokens = np.append(rng.integers(0, VOCAB_SIZE, size=rng.integers(min_length, max_length)), EOD)
        documents += [tokens, tokens.copy()]
    order = rng.permutation(len(documents))
    return [documents[i] for i in order]


def bag_of_tokens(texts: list[str]) -> np.ndarray:
    """float32 [n, EMBED_DIM]: token counts hashed into EMBED_DIM buckets, with each token's position in the
    text weighted in, so identical chunks (and only those, almost surely) are at distance 0."""
    vectors = np.zeros((len(texts), EMBED_DIM), dtype=np.float32)
    for row, text in enumerate(texts):
        for position, token in enumerate(text.split()):
            vectors[row, (int(token) * 7 + position * 13) % EMBED_DIM] += 1.0
    return vectors


def build_project(
    project_dir: str,
    documents: list[np.ndarray],
    train_samples: int = 64,
    global_batch_size: int = 4,
    eval_interval: int = 1000,
    eval_iters: int = 1,
    split: str = "90,10,0",
) -> RetroProject:
    """Write DIR/data, DIR/db, DIR/query/{train,valid} and DIR/config.json for `documents`."""
    os.makedirs(os.path.join(project_dir, DATA_DIR), exist_ok=True)
    write_corpus(os.path.join(project_dir, DATA_DIR, "corpus"), documents)
    write_vocab(os.path.join(project_dir, "bert_vocab.txt"))
    project = RetroProject(
        retro_gpt_data_path=["corpus"],
        retro_gpt_split=split,
        retro_gpt_seq_length=SEQ_LENGTH,
        retro_gpt_chunk_length=CHUNK_LENGTH,
        retro_gpt_seed=7,
        retro_gpt_train_samples=train_samples,
        retro_gpt_eval_interval=eval_interval,
        retro_gpt_eval_iters=eval_iters,
        retro_gpt_global_batch_size=global_batch_size,
        retro_gpt_tokenizer_type="NullTokenizer",
        retro_bert_tokenizer_type="BertWordPieceLowerCase",
        retro_bert_vocab_file="bert_vocab.txt",
        retro_block_size=50,
        retro_query_num_neighbors_save=NUM_SAVED_NEIGHBOURS,
        retro_neighbor_dirs={"train": "train", "valid": "valid", "test": None},
        retro_gpt_data_cache_path=os.path.join(project_dir, "cache"),
    )
    gpt_tokenizer = NullTokenizer(VOCAB_SIZE)
    bert_tokenizer = BertWordPieceTokenizer(os.path.join(project_dir, "bert_vocab.txt"))
    db = build_chunk_database(
        project.data_path(project_dir),
        db_dir(project_dir),
        ChunkDatabaseConfig(retro_gpt_chunk_length=CHUNK_LENGTH, retro_gpt_split=split),
        gpt_tokenizer,
        bert_tokenizer,
    )
    index = faiss.IndexFlatL2(EMBED_DIM)
    index.add(bag_of_tokens(db.chunk_texts(range(len(db)), gpt_tokenizer)))
    os.makedirs(os.path.dirname(index_path(project_dir)), exist_ok=True)
    with atomic_path(index_path(project_dir)) as tmp:
        faiss.write_index(index, tmp)
    data = DataConfig(
        data_path=project.data_path(project_dir),
        split=split,
        data_cache_path=project.retro_gpt_data_cache_path,
    )
    datasets = build_train_valid_test_datasets(
        data, SEQ_LENGTH, project.num_samples(), 7, EOD, VOCAB_SIZE + 1
    )
    query = QueryConfig(
        retro_query_num_neighbors_query=8,
        retro_query_num_neighbors_save=NUM_SAVED_NEIGHBOURS,
        retro_block_size=50,
    )
    query_pretraining_neighbours(
        datasets,
        db,
        index,
        bag_of_tokens,
        gpt_tokenizer,
        CHUNK_LENGTH,
        query,
        os.path.join(project_dir, "query"),
    )
    project.save(project_dir)
    return project
