"""The database update: held-out documents enter a Retro project's chunk database and filled index without
retraining the model or the index, and only their samples' neighbours are queried again.

Retro's claim is that new knowledge enters through the database, not the weights: after the update a Retro
model retrieves from the new documents (their own chunks included: that is the new knowledge), while a GPT
model, which retrieves nothing, is unchanged. The update is held in memory (`ChunkDatabase.with_chunks`, the
loaded index); the project on disk stays as it was. See docs/architecture.md (Retro flow).
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np
import torch

from megatron_train.data.blended import BlendedDataset
from megatron_train.data.gpt_dataset import GPTDataset
from megatron_train.tokenizer import MegatronTokenizer
from retro.db import ChunkDatabase, build_block
from retro.index import Embed, embed_chunks, embed_texts
from retro.query import gpt_sample, sample_chunk_texts

BERT_LENGTH_COLUMN = 4  # a chunk with no embedder tokens is invalid (never in the database)


@dataclass(frozen=True)
class DatabaseUpdate:
    """The database with the new chunks, the re-queried neighbours [samples * chunks per sample, k] of the
    first `samples` samples, and what the update touched."""

    db: ChunkDatabase
    neighbours: np.ndarray
    added_documents: int
    added_chunks: int
    queried_chunks: int


def split_documents(dataset: torch.utils.data.Dataset) -> list[tuple[GPTDataset, np.ndarray]]:
    """(GPT dataset, its sorted document ids) for each dataset behind a split's GPT or blended dataset."""
    gpts = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
    return [(gpt, np.unique(gpt.document_index)) for gpt in gpts]


def add_documents(
    dataset: torch.utils.data.Dataset,
    db: ChunkDatabase,
    index: faiss.Index,
    embed: Embed,
    gpt_tokenizer: MegatronTokenizer,
    bert_tokenizer: MegatronTokenizer,
    chunk_length: int,
) -> tuple[ChunkDatabase, int]:
    """Chunk the documents of `dataset` as the database's own (`retro.db.build_block`), embed only those
    chunks and add them to the trained, filled `index` under new chunk ids; returns (the database with them,
    the number of documents added)."""
    blocks, documents = [], 0
    for gpt, doc_ids in split_documents(dataset):
        dataset_idx = db.dataset_idx(gpt.dataset_path)
        block = build_block(
            db.datasets[dataset_idx],
            dataset_idx,
            doc_ids.tolist(),
            gpt_tokenizer,
            bert_tokenizer,
            chunk_length,
        )
        blocks.append(block[block[:, BERT_LENGTH_COLUMN] > 0])
        documents += len(doc_ids)
    updated = db.with_chunks(np.concatenate(blocks))
    new_ids = np.arange(len(db), len(updated), dtype=np.int64)
    index.add_with_ids(embed_chunks(updated, new_ids, embed, gpt_tokenizer), new_ids)
    return updated, documents


def requery(
    dataset: torch.utils.data.Dataset,
    samples: int,
    index: faiss.Index,
    embed: Embed,
    gpt_tokenizer: MegatronTokenizer,
    chunk_length: int,
    num_neighbors: int,
) -> np.ndarray:
    """int64 [samples * chunks per sample, num_neighbors]: the nearest chunks of every chunk of the first
    `samples` samples, own documents allowed."""
    texts = [
        text
        for sample in range(samples)
        for text in sample_chunk_texts(*gpt_sample(dataset, sample), chunk_length, gpt_tokenizer)
    ]
    _, found = index.search(embed_texts(embed, texts), num_neighbors)
    return found.astype(np.int64)


def update_database(
    dataset: torch.utils.data.Dataset,
    samples: int,
    db: ChunkDatabase,
    index: faiss.Index,
    embed: Embed,
    gpt_tokenizer: MegatronTokenizer,
    bert_tokenizer: MegatronTokenizer,
    chunk_length: int,
    num_neighbors: int,
) -> DatabaseUpdate:
    """Add the documents of `dataset` (a held-out split) to `db` and `index`, then re-query the neighbours of
    its first `samples` samples: nothing else is embedded or searched."""
    updated, documents = add_documents(dataset, db, index, embed, gpt_tokenizer, bert_tokenizer, chunk_length)
    neighbours = requery(dataset, samples, index, embed, gpt_tokenizer, chunk_length, num_neighbors)
    return DatabaseUpdate(updated, neighbours, documents, len(updated) - len(db), len(neighbours))
