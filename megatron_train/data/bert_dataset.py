"""Megatron-Core's BERTMaskedWordPieceDataset: `[CLS] A [SEP] B [SEP]` sentence pairs with masked tokens.

A sample's sentences are split at a random point into segments A and B; with the binary head, half the
pairs are swapped (B before A) and labelled `is_random` = 1 for the sentence-order loss. The pair is
trimmed to the sample's target length one token at a time (from the longer segment, at a random end),
then masked by `masked_dataset.ngram_masking` with Megatron's 80% [MASK] / 10% random / 10% kept
replacement (docs/architecture.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from megatron_train.data.masked_dataset import MaskedDatasetConfig, MaskedWordPieceDataset, ngram_masking


@dataclass(frozen=True, kw_only=True)
class BERTDatasetConfig(MaskedDatasetConfig):
    """BERT samples: `classification_head` False is `--bert-no-binary-head` (no sentence-order label)."""

    classification_head: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seq_length < 5:
            raise ValueError(f"--seq-length must be >= 5 for [CLS] A [SEP] B [SEP], got {self.seq_length}")


class BERTDataset(MaskedWordPieceDataset):
    """Item i: `text, types, labels, is_random, padding_mask, loss_mask, truncated` (Megatron's keys).

    `labels` holds the original id at masked positions and -1 elsewhere; `padding_mask` is 1 on tokens
    and 0 on padding; `types` is 0 for [CLS] A [SEP] and 1 for B [SEP].
    """

    config: BERTDatasetConfig

    @functools.cached_property
    def token_lookup(self) -> np.ndarray:
        """The vocabulary's ids, sorted: the random replacement draws one of them."""
        return np.array(sorted(self.config.tokenizer.inv_vocab), dtype=np.int64)

    def max_target_length(self) -> int:
        return self.config.seq_length - 3  # [CLS] and two [SEP]

    def min_sentences(self) -> int:
        return 2 if self.config.classification_head else 1

    def __getitem__(self, idx: int) -> dict[str, np.ndarray | int]:
        sentences, target_length, rng = self.sample_sentences(idx)
        config, tokenizer = self.config, self.config.tokenizer

        pivot, is_next_random = len(sentences), False
        if config.classification_head:
            pivot = rng.randint(low=1, high=len(sentences)) if len(sentences) >= 3 else 1
            is_next_random = rng.random() < 0.5
        segment_a = [token for sentence in sentences[:pivot] for token in sentence]
        segment_b = [token for sentence in sentences[pivot:] for token in sentence]
        if is_next_random:
            segment_a, segment_b = segment_b, segment_a

        truncated = len(segment_a) + len(segment_b) > target_length
        while len(segment_a) + len(segment_b) > target_length:
            longer = segment_a if len(segment_a) > len(segment_b) else segment_b
            del longer[0 if rng.random() < 0.5 else -1]

        tokens = [tokenizer.cls, *segment_a, tokenizer.sep]
        types = [0] * len(tokens)
        if segment_b:
            tokens += [*segment_b, tokenizer.sep]
            types += [1] * (len(segment_b) + 1)

        tokens, positions, masked_labels = ngram_masking(
            tokens, target_length, rng, config, self.continuation_ids, self._replacement
        )

        length, seq_length = len(tokens), config.seq_length
        text = np.zeros(seq_length, dtype=np.int64)  # padding is id 0, which the embedding can map
        text[:length] = tokens
        token_types = np.zeros(seq_length, dtype=np.int64)
        token_types[:length] = types
        padding_mask = np.zeros(seq_length, dtype=np.int64)
        padding_mask[:length] = 1
        labels = np.full(seq_length, -1, dtype=np.int64)
        labels[positions] = masked_labels
        loss_mask = np.zeros(seq_length, dtype=np.int64)
        loss_mask[positions] = 1
        return {
            "text": text,
            "types": token_types,
            "labels": labels,
            "is_random": int(is_next_random),
            "padding_mask": padding_mask,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
        }

    def _replacement(self, rng: np.random.RandomState) -> int | None:
        """80%: [MASK]; 10%: a random id of the vocabulary; 10%: keep the token (None)."""
        if rng.random() < 0.8:
            return self.config.tokenizer.mask
        if rng.random() >= 0.5:
            return int(self.token_lookup[rng.randint(0, len(self.token_lookup))])
        return None
