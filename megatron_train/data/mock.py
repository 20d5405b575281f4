"""`--mock-data`: deterministic synthetic token sequences, so training runs without any data files.

Like Megatron's `MockGPTLowLevelDataset`: 100,000 sequences of 1 to 4095 tokens (lengths drawn from a
fixed seed), each ending with the end-of-document token; the sequences go through the real GPTDataset
index machinery, uncached.
"""

from __future__ import annotations

import numpy as np

from megatron_train.data.config import split_bounds
from megatron_train.data.gpt_dataset import GPTDataset, GPTDatasetConfig, Split


class MockSequences:
    """Sequence i is `length - 1` tokens counting up from i (wrapping below `vocab_size`, skipping eod), then eod."""

    seed = 0
    size = 100_000
    max_sequence_length = 4096

    def __init__(self, eod: int, vocab_size: int | None = None) -> None:
        self.eod = eod
        self.vocab_size = eod + 1 if vocab_size is None else vocab_size
        if not 0 <= eod < self.vocab_size or self.vocab_size < 2:
            raise ValueError(
                f"mock data needs 0 <= eod < vocab_size and vocab_size >= 2, got eod {eod} and "
                f"vocab_size {self.vocab_size}"
            )
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(1, self.max_sequence_length, size=self.size, dtype=np.int32)

    def __len__(self) -> int:
        return self.size

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        sequence_length = int(self.sequence_lengths[i])
        if length is None:
            length = sequence_length - offset
        positions = np.arange(offset, offset + length, dtype=np.int64)
        tokens = (i + positions) % (self.vocab_size - 1)
        tokens[tokens >= self.eod] += 1
        tokens[positions == sequence_length - 1] = self.eod
        return tokens


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockSequences for one split; `vocab_size` bounds the synthetic token ids."""

    def __init__(
        self,
        num_samples: int | None,
        split: Split,
        config: GPTDatasetConfig,
        bookend: tuple[float, float],
        vocab_size: int | None = None,
    ) -> None:
        sequences = MockSequences(config.eod, vocab_size)
        begin, end = split_bounds(bookend, len(sequences))
        documents = np.arange(begin, end, dtype=np.int32)
        super().__init__(sequences, None, documents, num_samples, split, config, cache_dir=None)
