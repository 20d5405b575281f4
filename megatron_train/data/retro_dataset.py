"""RetroDataset: a GPT sample plus the tokens of the neighbours retrieved for each of its chunks.

Megatron's RetroDataset (megatron/core/datasets/retro/query/retro_dataset.py). It wraps the GPT dataset (or
blend) that the Retro neighbours were queried for: the same blend, split, seed, sequence length and sample
counts, so sample i's chunk j is neighbour row i * l + j (l = seq_length / chunk_length). Each sample is the
GPT sample's fields plus `neighbor_tokens` int64 [l, k, r]: for each of the first k (`--retro-num-neighbors`)
neighbours of each chunk, the tokens of database chunks n, n + 1, ... (`--retro-num-retrieved-chunks` of
them: the neighbour and its continuation, the next database row, wrapping around the database as Megatron
does), r = num_retrieved_chunks x chunk_length tokens. A chunk shorter than chunk_length (a document's last)
is padded with the EOD token, as Megatron's DBDataset; a neighbour the query did not find (saved as -1) is r EOD
tokens (Megatron read the database's last chunk for it, an accident of Python's -1 index).
See docs/architecture.md (Retro model).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class ChunkDatabase(Protocol):
    """What RetroDataset reads of the chunk database (`retro.db.ChunkDatabase`): chunk id -> GPT tokens."""

    def __len__(self) -> int: ...

    def chunk_tokens(self, chunk_id: int) -> np.ndarray: ...


class RetroDataset(torch.utils.data.Dataset):
    """GPT samples with `neighbor_tokens` [chunks, num_neighbors, num_retrieved_chunks * chunk_length]."""

    def __init__(
        self,
        gpt_dataset: torch.utils.data.Dataset,
        neighbours: np.ndarray,
        db: ChunkDatabase,
        seq_length: int,
        chunk_length: int,
        num_neighbors: int,
        num_retrieved_chunks: int,
        eod: int,
        verify_neighbor_count: bool = True,
    ) -> None:
        if seq_length % chunk_length:
            raise ValueError(
                f"--seq-length {seq_length} is not a multiple of the Retro chunk length {chunk_length}"
            )
        self.chunks_per_sample = seq_length // chunk_length
        expected = len(gpt_dataset) * self.chunks_per_sample
        if verify_neighbor_count and len(neighbours) != expected:
            raise ValueError(
                f"the saved neighbours cover {len(neighbours)} chunks but the {len(gpt_dataset)} samples have "
                f"{expected}: query the neighbours for these samples (same blend, split, seed, sample counts), "
                "or pass --retro-no-verify-neighbor-count"
            )
        if neighbours.shape[1] < num_neighbors:
            raise ValueError(
                f"--retro-num-neighbors {num_neighbors} exceeds the {neighbours.shape[1]} neighbours saved per "
                "chunk (--retro-query-num-neighbors-save); lower it or query more"
            )
        if len(db) == 0:
            raise ValueError("the chunk database is empty: Retro needs chunks to retrieve")
        self.gpt_dataset = gpt_dataset
        self.neighbours = neighbours
        self.db = db
        self.chunk_length = chunk_length
        self.num_neighbors = num_neighbors
        self.num_retrieved_chunks = num_retrieved_chunks
        self.eod = eod

    def __len__(self) -> int:
        return len(self.gpt_dataset)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        first = idx * self.chunks_per_sample
        ids = self.neighbours[first : first + self.chunks_per_sample, : self.num_neighbors]
        tokens = neighbor_tokens(self.db, ids, self.chunk_length, self.num_retrieved_chunks, self.eod)
        return {**self.gpt_dataset[idx], "neighbor_tokens": tokens}


def neighbor_tokens(
    db: ChunkDatabase, neighbour_ids: np.ndarray, chunk_length: int, num_retrieved_chunks: int, eod: int
) -> np.ndarray:
    """int64 [..., num_retrieved_chunks * chunk_length]: the tokens of each neighbour id in [...] and its
    continuation (see the module doc); -1 gives EOD tokens only."""
    tokens = np.full((*neighbour_ids.shape, num_retrieved_chunks * chunk_length), eod, dtype=np.int64)
    for position in np.ndindex(neighbour_ids.shape):
        neighbour = int(neighbour_ids[position])
        if neighbour < 0:
            continue
        for i in range(num_retrieved_chunks):
            chunk = db.chunk_tokens((neighbour + i) % len(db))
            tokens[position][i * chunk_length : i * chunk_length + len(chunk)] = chunk
    return tokens
