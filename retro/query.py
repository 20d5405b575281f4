"""Retro's pretraining neighbours: for every chunk of every GPT sample, the nearest database chunks.

The samples are those pretraining reads: the `GPTDataset` (or `BlendedDataset` of them) that
`megatron_train.data.build_train_valid_test_datasets` builds with the same blend, split, seed and
sample counts. Sample i's first `seq_length` tokens are cut into `seq_length / retro_gpt_chunk_length`
chunks, chunk id `i * chunks_per_sample + j`. Each chunk's text is embedded and searched for
`--retro-query-num-neighbors-query` neighbours; neighbours from a document the sample itself spans are
dropped (the model must not retrieve the text it is predicting), the first
`--retro-query-num-neighbors-save` kept, missing ones -1. A share of the training samples can be queried as
held-out documents (`HeldOutSamples`): neighbours from their documents' near-duplicates are dropped too, so that
the model also trains on chunks whose neighbours hold what a held-out document's would, not a copy of the text.
Blocks of `--retro-block-size` chunks are committed one `.npy` (int64 [n, save]) each, so a killed query resumes
at the first missing block.
See docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass

import faiss
import numpy as np
import torch

from megatron_train.data.blended import BlendedDataset
from megatron_train.data.gpt_dataset import GPTDataset
from megatron_train.tokenizer import MegatronTokenizer
from retro.blocks import SETTINGS_FILE, block_path, check_settings, load_blocks, missing_blocks, save_block
from retro.config import QueryConfig
from retro.db import ChunkDatabase, document_key
from retro.index import Embed, embed_texts

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def gpt_sample(dataset: torch.utils.data.Dataset, idx: int) -> tuple[GPTDataset, int]:
    """The GPTDataset and its sample index behind sample `idx` of a GPT or blended dataset."""
    if isinstance(dataset, BlendedDataset):
        return dataset.datasets[int(dataset.dataset_index[idx])], int(dataset.dataset_sample_index[idx])
    return dataset, idx


def sample_document_ids(dataset: GPTDataset, idx: int) -> np.ndarray:
    """The sequence ids (GPT documents) whose tokens sample `idx` holds, as Megatron's `document_ids`."""
    position = int(dataset.shuffle_index[idx])
    first, last = int(dataset.sample_index[position][0]), int(dataset.sample_index[position + 1][0])
    return np.unique(dataset.document_index[first : last + 1]).astype(np.int64)


def sample_chunk_texts(
    dataset: GPTDataset, idx: int, chunk_length: int, gpt_tokenizer: MegatronTokenizer
) -> list[str]:
    """The GPT-detokenized text of each chunk of sample `idx` (what the embedder reads for a query)."""
    seq_length = dataset.config.seq_length
    tokens = dataset.sample_tokens(idx)[:seq_length]
    texts = []
    for offset in range(0, seq_length, chunk_length):
        chunk = tokens[offset : offset + chunk_length]
        chunk = chunk[chunk >= 0]  # a short last sample is padded with -1
        texts.append(gpt_tokenizer.detokenize(chunk.tolist()))
    return texts


def exclude_own_documents(
    neighbour_ids: np.ndarray, chunk_keys: np.ndarray, banned_keys: list[np.ndarray], num_save: int
) -> np.ndarray:
    """Row r of `neighbour_ids` without the ids (and -1s) whose document key is in `banned_keys[r]`,
    order kept, cut or padded with -1 to `num_save` columns."""
    found = neighbour_ids >= 0
    keys = chunk_keys[np.where(found, neighbour_ids, 0)]
    banned = np.stack([np.isin(row, ban) for row, ban in zip(keys, banned_keys, strict=True)])
    keep = found & ~banned
    order = np.argsort(~keep, axis=1, kind="stable")  # kept ids first, in search order
    kept = np.take_along_axis(np.where(keep, neighbour_ids, -1), order, axis=1)[:, :num_save]
    padding = np.full((len(kept), num_save - kept.shape[1]), -1, dtype=np.int64)
    return np.concatenate([kept.astype(np.int64), padding], axis=1)


@dataclass(frozen=True)
class HeldOutSamples:
    """Training samples queried as if their documents were held out of the database: `share` of the samples
    (drawn with `seed`), whose banned documents grow from their own to every document of the same near-duplicate
    group. `groups[d][i]` is the group of document i of the database's dataset d (stages.retro_query draws them
    from MinHash similarity)."""

    share: float
    seed: int
    groups: list[np.ndarray]

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"the held-out share of training samples must be in [0, 1], got {self.share}")

    def chosen(self, num_samples: int) -> np.ndarray:
        """bool [num_samples]: which samples are queried as held out."""
        return np.random.default_rng(self.seed).random(num_samples) < self.share

    def group_keys(self) -> dict[int, np.ndarray]:
        """Document key -> the keys of every document in its group."""
        keys = np.concatenate([document_key(d, np.arange(len(g))) for d, g in enumerate(self.groups)])
        labels = np.concatenate(
            [np.stack([np.full(len(g), d), g], axis=1) for d, g in enumerate(self.groups)]
        )
        _, group_ids = np.unique(labels, axis=0, return_inverse=True)
        order = np.argsort(group_ids, kind="stable")
        members = np.split(keys[order], np.flatnonzero(np.diff(group_ids[order])) + 1)
        return {int(k): members[g] for k, g in zip(keys, group_ids, strict=True)}

    def settings(self) -> dict:
        """What the committed blocks depend on: the share, the seed and the groups (by digest)."""
        digest = hashlib.md5(
            b"".join(np.asarray(g, dtype=np.int64).tobytes() for g in self.groups)
        ).hexdigest()
        return {"held_out_share": self.share, "held_out_seed": self.seed, "held_out_groups": digest}


def query_neighbours(
    dataset: torch.utils.data.Dataset,
    db: ChunkDatabase,
    index: faiss.Index,
    embed: Embed,
    gpt_tokenizer: MegatronTokenizer,
    chunk_length: int,
    config: QueryConfig,
    out_dir: str,
    held_out: HeldOutSamples | None = None,
) -> int:
    """Write the neighbours of every chunk of `dataset` (one split) in blocks under `out_dir`;
    returns the number of chunks. Blocks already committed are skipped."""
    gpt_datasets = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
    seq_length = gpt_datasets[0].config.seq_length
    if seq_length % chunk_length:
        raise ValueError(
            f"--seq-length {seq_length} is not a multiple of --retro-gpt-chunk-length {chunk_length}: "
            "Retro samples must split into whole chunks"
        )
    chunks_per_sample = seq_length // chunk_length
    num_chunks = len(dataset) * chunks_per_sample
    if any(d.dataset_path is None for d in gpt_datasets):
        raise ValueError(
            "Retro neighbours need the GPT datasets of a --data-path blend (the chunk database's corpus), "
            "not --mock-data"
        )
    db_dataset_idx = {id(d): db.dataset_idx(d.dataset_path) for d in gpt_datasets}
    chunk_keys = db.document_keys()
    check_settings(
        out_dir,
        {
            **asdict(config),
            "db_dir": os.path.abspath(db.db_dir),
            "chunk_length": chunk_length,
            "num_chunks": num_chunks,
            "samples": hashlib.md5(dataset.unique_description.encode()).hexdigest(),
            **(held_out.settings() if held_out else {}),
        },
    )
    chosen = held_out.chosen(len(dataset)) if held_out else np.zeros(len(dataset), dtype=bool)
    group_keys = held_out.group_keys() if held_out else {}
    missing = missing_blocks(out_dir, num_chunks, config.retro_block_size)
    for number, (start, end) in enumerate(missing):
        texts, banned = [], []
        for sample in range(start // chunks_per_sample, (end - 1) // chunks_per_sample + 1):
            gpt, idx = gpt_sample(dataset, sample)
            keys = document_key(db_dataset_idx[id(gpt)], sample_document_ids(gpt, idx))
            if chosen[sample]:
                keys = np.unique(np.concatenate([group_keys[int(k)] for k in keys]))
            first_chunk = sample * chunks_per_sample
            sample_texts = sample_chunk_texts(gpt, idx, chunk_length, gpt_tokenizer)
            for chunk_id in range(max(start, first_chunk), min(end, first_chunk + chunks_per_sample)):
                texts.append(sample_texts[chunk_id - first_chunk])
                banned.append(keys)
        _, found = index.search(embed_texts(embed, texts), config.retro_query_num_neighbors_query)
        neighbours = exclude_own_documents(found, chunk_keys, banned, config.retro_query_num_neighbors_save)
        save_block(block_path(out_dir, start, end), neighbours)
        logger.info(
            "retro query: chunks [%d, %d) of %d (block %d/%d)",
            start,
            end,
            num_chunks,
            number + 1,
            len(missing),
        )
    return num_chunks


def query_pretraining_neighbours(
    datasets: tuple[torch.utils.data.Dataset | None, ...],
    db: ChunkDatabase,
    index: faiss.Index,
    embed: Embed,
    gpt_tokenizer: MegatronTokenizer,
    chunk_length: int,
    config: QueryConfig,
    out_dir: str,
    held_out: HeldOutSamples | None = None,
) -> dict[str, int]:
    """`query_neighbours` for the (train, valid, test) datasets into `out_dir/<split>`; None splits skipped.
    `held_out` applies to the training samples only: validation documents are held out for real."""
    return {
        name: query_neighbours(
            dataset,
            db,
            index,
            embed,
            gpt_tokenizer,
            chunk_length,
            config,
            os.path.join(out_dir, name),
            held_out if name == "train" else None,
        )
        for name, dataset in zip(SPLIT_NAMES, datasets, strict=True)
        if dataset is not None
    }


def load_neighbours(out_dir: str) -> np.ndarray:
    """int64 [num_chunks, num_neighbors_save]: the neighbour chunk ids of every chunk of one split."""
    with open(os.path.join(out_dir, SETTINGS_FILE), encoding="utf-8") as f:
        settings = json.load(f)
    return np.concatenate(load_blocks(out_dir, settings["num_chunks"], settings["retro_block_size"]))
