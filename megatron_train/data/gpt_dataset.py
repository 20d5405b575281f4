"""Megatron-Core's GPTDataset: fixed-length samples cut across the sequences of one split.

The split's sequences (Megatron's GPT "documents" are the `.idx` sequences) are shuffled, laid end
to end for as many epochs as the requested samples need, and cut every `seq_length` tokens into
samples of `seq_length + 1` tokens (inputs and shifted labels). The three index arrays that do this
come from `indices.py` and are cached on disk under a hash of everything that determines them.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from megatron_train.data.indices import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    load_or_build_indices,
    num_epochs_needed,
    separate_final_epoch_split,
)

logger = logging.getLogger(__name__)

PAD_TOKEN_ID = -1  # Megatron's `_PAD_TOKEN_ID`: fills a partial last sample; masked out of the loss


class Split(enum.Enum):
    train = 0
    valid = 1
    test = 2


class TokenSequences(Protocol):
    """What GPTDataset reads: `storage.indexed_dataset.IndexedDataset` or the mock data."""

    sequence_lengths: np.ndarray

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


@dataclass(frozen=True)
class GPTDatasetConfig:
    """The settings that shape GPT samples (resolved from DataConfig and the training flags)."""

    seq_length: int
    seed: int
    eod: int
    split: str
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    drop_last_partial_validation_sequence: bool = True


class GPTDataset(torch.utils.data.Dataset):
    """Samples of one split of one token dataset; item i is a dict of numpy arrays of length seq_length.

    `documents` are the sequence ids of this split; `num_samples` None means one epoch.
    `cache_dir` None builds the indices without caching them.
    """

    def __init__(
        self,
        sequences: TokenSequences,
        dataset_path: str | None,
        documents: np.ndarray,
        num_samples: int | None,
        split: Split,
        config: GPTDatasetConfig,
        cache_dir: str | None,
    ) -> None:
        if config.seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {config.seq_length}")
        self.sequences = sequences
        self.dataset_path = dataset_path
        self.documents = np.asarray(documents, dtype=np.int32)
        self.num_samples = num_samples
        self.split = split
        self.config = config
        lengths = np.ascontiguousarray(sequences.sequence_lengths[self.documents])
        self.tokens_per_epoch = int(np.sum(lengths, dtype=np.int64))
        if self.tokens_per_epoch <= 1:
            raise ValueError(
                f"{dataset_path or type(sequences).__name__}: the {split.name} split has "
                f"{len(self.documents)} sequences and {self.tokens_per_epoch} tokens, too few for one "
                "sample; give it more data or a larger share of --split"
            )
        self.unique_identifiers = {
            "class": type(self).__name__,
            "dataset_path": dataset_path,
            "num_samples": num_samples,
            "index_split": split.name,
            "random_seed": config.seed,
            "sequence_length": config.seq_length,
            "split": config.split,
            # Which sequences, and their lengths: data rewritten under the same path gets new indices.
            "documents_md5": hashlib.md5(self.documents.tobytes() + lengths.tobytes()).hexdigest(),
            "drop_last_partial_sequence": self._drop_last_partial_sequence(),
        }
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        arrays = load_or_build_indices(
            cache_dir,
            self.unique_description,
            f"{type(self).__name__}-{split.name}",
            ("document_index", "sample_index", "shuffle_index"),
            self._build_indices,
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    @staticmethod
    def num_elements(sequences: TokenSequences) -> int:
        """What --split divides: sequences (GPT's "documents")."""
        return len(sequences.sequence_lengths)

    def _drop_last_partial_sequence(self) -> bool:
        return self.split != Split.valid or self.config.drop_last_partial_validation_sequence

    def _build_indices(self) -> dict[str, np.ndarray]:
        """Megatron's `_build_document_sample_shuffle_indices`, with the same RandomState draws."""
        config = self.config
        num_epochs = num_epochs_needed(self.tokens_per_epoch, self.num_samples, config.seq_length, 1)
        samples_before_final_epoch = (
            None
            if self.num_samples is None
            else separate_final_epoch_split(
                self.tokens_per_epoch, num_epochs, self.num_samples, config.seq_length, 1
            )
        )
        rng = np.random.RandomState(config.seed)
        document_index = build_document_index(
            self.documents, num_epochs, rng, samples_before_final_epoch is not None
        )
        sample_index = build_sample_index(
            self.sequences.sequence_lengths,
            document_index,
            config.seq_length,
            num_epochs,
            self.tokens_per_epoch,
            self._drop_last_partial_sequence(),
        )
        num_built = sample_index.shape[0] - 1
        shuffle_index = build_shuffle_index(
            num_built if samples_before_final_epoch is None else samples_before_final_epoch, num_built, rng
        )
        logger.info(
            "%s %s: %d samples over %d epochs of %d tokens",
            type(self).__name__,
            self.split.name,
            num_built,
            num_epochs,
            self.tokens_per_epoch,
        )
        return {
            "document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": shuffle_index,
        }

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The `seq_length + 1` tokens of sample `idx` (int64), padded with PAD_TOKEN_ID if short.

        Consecutive samples share one token: the label of one sample's last input is the next one's first.
        """
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {type(self).__name__} of {len(self)} samples")
        position = int(self.shuffle_index[idx])
        first_document, first_offset = (int(v) for v in self.sample_index[position])
        last_document, last_offset = (int(v) for v in self.sample_index[position + 1])
        parts = []
        for i in range(first_document, last_document + 1):
            offset = first_offset if i == first_document else 0
            length = last_offset + 1 - offset if i == last_document else None
            parts.append(self.sequences.get(int(self.document_index[i]), offset=offset, length=length))
        tokens = np.concatenate(parts).astype(np.int64)
        missing = self.config.seq_length + 1 - len(tokens)
        if missing > 0:
            tokens = np.concatenate([tokens, np.full(missing, PAD_TOKEN_ID, dtype=np.int64)])
        return tokens

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        text = self.sample_tokens(idx)
        tokens, labels = text[:-1].copy(), text[1:].copy()
        loss_mask = np.ones(len(tokens), dtype=np.float32)
        if self.config.eod_mask_loss:
            loss_mask[tokens == self.config.eod] = 0.0
        loss_mask[labels == PAD_TOKEN_ID] = 0.0
        position_ids = np.arange(len(tokens), dtype=np.int64)
        if self.config.reset_position_ids:
            position_ids -= document_starts(tokens, self.config.eod)
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if self.config.reset_attention_mask:
            sample["document_ids"] = document_ids(tokens, self.config.eod)
        tokens[tokens == PAD_TOKEN_ID] = 0
        labels[labels == PAD_TOKEN_ID] = 0
        return sample


def document_ids(tokens: np.ndarray, eod: int) -> np.ndarray:
    """For each position, the number of eod tokens before it: the sample's document it belongs to, an eod
    counted with the document it ends (what --reset-attention-mask attends within)."""
    ids = np.zeros(len(tokens), dtype=np.int64)
    ids[1:] = np.cumsum(tokens[:-1] == eod)
    return ids


def document_starts(tokens: np.ndarray, eod: int) -> np.ndarray:
    """For each position, where its document began: 0, or the position after the latest earlier eod."""
    starts = np.zeros(len(tokens), dtype=np.int64)
    after_eod = np.nonzero(tokens[:-1] == eod)[0] + 1
    starts[after_eod] = after_eod
    return np.maximum.accumulate(starts)
