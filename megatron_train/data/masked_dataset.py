"""What the BERT and T5 datasets share: sentence-pair sample mapping, its cache, and WordPiece masking.

Ports of Megatron-Core's `masked_dataset.py` and `helpers.cpp::build_mapping` (docs/architecture.md).
Their input is a sentence-split token dataset (`stages.tokenize --split-sentences`: each `.idx` sequence
is a sentence, each document a run of sentences). A sample is a run of whole sentences of one document;
the sample index row (first sentence, end sentence, target length) is drawn with the same mt19937 /
mt19937_64 streams as Megatron's C++, so a Megatron user gets the same samples in the same order.
Per-sample randomness (pair split, masking) comes from `RandomState(seed + idx)`, as in Megatron.
"""

from __future__ import annotations

import abc
import bisect
import functools
import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from megatron_train.data.gpt_dataset import Split
from megatron_train.data.indices import load_or_build_indices
from megatron_train.tokenizer.base import MegatronTokenizer
from storage.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

LONG_SENTENCE_LENGTH = 512  # helpers.cpp LONG_SENTENCE_LEN: documents with a longer sentence are skipped
UINT32_MAX = np.iinfo(np.uint32).max


@dataclass(frozen=True, kw_only=True)
class MaskedDatasetConfig:
    """Megatron's `MaskedWordPieceDatasetConfig`, reduced to the options BERT and T5 pretraining use."""

    seq_length: int
    seed: int
    tokenizer: MegatronTokenizer
    split: str = ""  # --split, part of the cache key; the builder sets it from DataConfig
    masking_probability: float = 0.15  # --mask-prob
    short_sequence_probability: float = 0.1  # --short-seq-prob
    masking_max_ngram: int = 3
    masking_do_full_word: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.masking_probability < 1:
            raise ValueError(f"--mask-prob must be in (0, 1), got {self.masking_probability}")
        if not 0 <= self.short_sequence_probability <= 1:
            raise ValueError(f"--short-seq-prob must be in [0, 1], got {self.short_sequence_probability}")
        if self.masking_max_ngram < 1:
            raise ValueError(f"masking_max_ngram must be >= 1, got {self.masking_max_ngram}")
        if self.seed <= 0:
            raise ValueError(
                f"--seed must be > 0 for the BERT/T5 sample mapping (Megatron's), got {self.seed}"
            )
        self.require_special_tokens("cls", "sep", "mask")

    def require_special_tokens(self, *names: str) -> None:
        """An error saying which tokenizer to use when the tokenizer lacks one of these special tokens."""
        for name in names:
            try:
                present = getattr(self.tokenizer, name) >= 0  # Megatron's tokenizers give -1 for none
            except NotImplementedError:
                present = False
            if not present:
                raise ValueError(
                    f"{type(self.tokenizer).__name__} has no {name} token: BERT/T5 data needs a WordPiece "
                    "tokenizer with [CLS], [SEP], [MASK], [BOS] and [EOS]; use --tokenizer-type "
                    "BertWordPieceLowerCase or BertWordPieceCase"
                )


# ---------------------------------------------------------------- random streams of helpers.cpp


class MT19937Stream:
    """The outputs of C++ `std::mt19937(seed)`: numpy's legacy RandomState seeds MT19937 the same way."""

    def __init__(self, seed: int, block: int = 4096) -> None:
        self._state = np.random.RandomState(seed)
        self._block = block
        self._values: list[int] = []
        self._next = 0

    def __call__(self) -> int:
        if self._next == len(self._values):
            # A full-range uint32 draw returns the generator's raw outputs in order.
            self._values = self._state.randint(0, 1 << 32, size=self._block, dtype=np.uint32).tolist()
            self._next = 0
        self._next += 1
        return self._values[self._next - 1]


def mt19937_64(seed: int, count: int) -> np.ndarray:
    """The first `count` outputs (uint64) of C++ `std::mt19937_64(seed)`, the 64-bit Mersenne Twister."""
    n, m = 312, 156
    upper, lower = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)
    matrix = np.uint64(0xB5026F5AA96619E9)
    state = [seed & 0xFFFFFFFFFFFFFFFF]
    for i in range(1, n):
        previous = state[-1]
        state.append((6364136223846793005 * (previous ^ (previous >> 62)) + i) & 0xFFFFFFFFFFFFFFFF)
    mt = np.array(state, dtype=np.uint64)

    def twisted(high: np.ndarray, low: np.ndarray, far: np.ndarray) -> np.ndarray:
        x = (high & upper) | (low & lower)
        return far ^ (x >> np.uint64(1)) ^ np.where(x & np.uint64(1), matrix, np.uint64(0))

    blocks = []
    for _ in range(-(-count // n)):
        # The C++ loop, in three vectorised runs: each reads only entries already final for its step.
        mt[: n - m] = twisted(mt[: n - m], mt[1 : n - m + 1], mt[m:])
        mt[n - m : n - 1] = twisted(mt[n - m : n - 1], mt[n - m + 1 :], mt[: m - 1])
        mt[n - 1 :] = twisted(mt[n - 1 :], mt[:1], mt[m - 1 : m])
        x = mt.copy()
        x ^= (x >> np.uint64(29)) & np.uint64(0x5555555555555555)
        x ^= (x << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        x ^= (x << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        x ^= x >> np.uint64(43)
        blocks.append(x)
    return np.concatenate(blocks)[:count] if blocks else np.zeros(0, dtype=np.uint64)


def _target_length(short_seq_ratio: int, max_length: int, draw: MT19937Stream) -> int:
    """helpers.cpp `get_target_sample_len`: 1 in `short_seq_ratio` samples gets a random shorter target."""
    if short_seq_ratio == 0:
        return max_length
    number = draw()
    if number % short_seq_ratio == 0:
        return 2 + number % (max_length - 1)
    return max_length


def build_sentence_sample_index(
    document_indices: np.ndarray,
    sentence_lengths: np.ndarray,
    num_epochs: int,
    max_num_samples: int,
    max_seq_length: int,
    short_seq_prob: float,
    seed: int,
    min_sentences: int,
) -> np.ndarray:
    """helpers.cpp `build_mapping`: rows (first sentence, end sentence, target length), shuffled.

    `document_indices` are the first sentence of each document, plus the end of the last. Within each
    document with >= `min_sentences` sentences (none over LONG_SENTENCE_LENGTH tokens), sentences are
    gathered until the target length is reached, leaving no lone sentence at the end of the document.
    Whole epochs are built until `max_num_samples` rows exist.
    """
    if max_seq_length <= 1:
        raise ValueError(f"the sample length must leave room for 2 tokens, got {max_seq_length}")
    # C++ `round`: halves away from zero (Python's `round` would take 2.5 to 2).
    short_seq_ratio = math.floor(1.0 / short_seq_prob + 0.5) if short_seq_prob > 0 else 0
    draw = MT19937Stream(seed)
    starts = np.asarray(document_indices, dtype=np.int64)
    lengths = np.asarray(sentence_lengths, dtype=np.int64)
    long_before = np.concatenate(([0], np.cumsum(lengths > LONG_SENTENCE_LENGTH)))
    sizes = np.diff(starts)
    has_long = (long_before[starts[1:]] - long_before[starts[:-1]] > 0) & (sizes > 1)
    usable = np.nonzero((sizes >= min_sentences) & ~has_long)[0]
    documents = list(zip(starts[usable].tolist(), starts[usable + 1].tolist(), strict=True))
    # tokens_before[i]: the tokens of sentences 0..i-1, so a run's length is a difference of two entries.
    tokens_before = np.concatenate(([0], np.cumsum(lengths)))
    rows: list[tuple[int, int, int]] = []
    for _ in range(num_epochs):
        if len(rows) >= max_num_samples:
            break
        for first, last in documents:
            document_tokens_before = tokens_before[first : last + 1].tolist()
            begin, size = 0, last - first
            while begin < size:
                target = _target_length(short_seq_ratio, max_seq_length, draw)
                # The C++ adds sentences until the run reaches `target` tokens and `min_sentences`
                # sentences with at least 2 sentences left over; else the run takes the rest of the document.
                wanted = document_tokens_before[begin] + target
                reaches_target = bisect.bisect_left(document_tokens_before, wanted, begin + 1)
                end = max(reaches_target, begin + min_sentences)
                if end > size - 2:
                    end = size
                rows.append((first + begin, first + end, target))
                begin = end
            # The C++ draws the next target after every sample, the document's last one included.
            _target_length(short_seq_ratio, max_seq_length, draw)
        if not rows:
            raise ValueError(
                f"no document has {min_sentences} or more sentences (all of at most {LONG_SENTENCE_LENGTH} "
                "tokens) to make a sample from; tokenize with --split-sentences, or give more data"
            )
    dtype = np.uint64 if len(lengths) > UINT32_MAX else np.uint32
    sample_index = np.array(rows, dtype=dtype).reshape(-1, 3)
    # Fisher-Yates with mt19937_64(seed + 1), as the C++ does it, applied as one permutation.
    num_samples = len(sample_index)
    positions = np.arange(num_samples - 1, 0, -1, dtype=np.uint64)
    swaps = (mt19937_64(seed + 1, len(positions)) % (positions + np.uint64(1))).tolist()
    order = list(range(num_samples))
    for i, j in zip(positions.tolist(), swaps, strict=True):
        order[i], order[j] = order[j], order[i]
    return sample_index[order]


# ---------------------------------------------------------------- masking


def ngram_masking(
    token_ids: list[int],
    target_sequence_length: int,
    rng: np.random.RandomState,
    config: MaskedDatasetConfig,
    continuation_ids: frozenset[int],
    replacement: Callable[[np.random.RandomState], int | None],
) -> tuple[list[int], list[int], list[int]]:
    """Megatron's `_create_masked_lm_predictions` (no permutation, no geometric spans): masked ids,
    masked positions (sorted) and their original ids.

    Candidates are words (a token and its "##" continuations with whole-word masking, else single
    tokens); [CLS] and [SEP] never are. Candidates are visited in random order and each masks an n-gram
    of up to `masking_max_ngram` candidates (P(n) proportional to 1/n), shortened to fit the budget of
    `masking_probability` of the tokens. `replacement(rng)` gives each masked token's new id (None: keep).
    """
    tokenizer = config.tokenizer
    special = (tokenizer.cls, tokenizer.sep)
    candidates: list[list[int]] = []
    for i, token_id in enumerate(token_ids):
        if token_id in special:
            continue
        if token_id in continuation_ids and config.masking_do_full_word and candidates:
            candidates[-1].append(i)
        else:
            candidates.append([i])

    probability = config.masking_probability
    n_maskings = min(probability * target_sequence_length, max(1, int(round(len(token_ids) * probability))))
    ngram_cdf = _ngram_cdf(config.masking_max_ngram)

    order = np.arange(len(candidates))
    rng.shuffle(order)  # the same draws as Megatron's shuffle of its candidate n-gram list
    masked_ids = list(token_ids)
    masked: list[tuple[int, int]] = []
    masked_indices: set[int] = set()
    for start in order.tolist():
        if len(masked) >= n_maskings:
            break
        # Megatron's `rng.choice(ngram_sizes, p=probabilities)`: one uniform draw against the CDF.
        n = bisect.bisect_right(ngram_cdf, rng.random_sample()) + 1
        while True:  # the longest n-gram up to n that still fits the budget
            indices = [index for word in candidates[start : start + n] for index in word]
            n -= 1
            if n_maskings >= len(masked) + len(indices):
                break
            if n == 0:
                indices = []
                break
        if not indices or any(index in masked_indices for index in indices):
            continue
        for index in indices:
            masked_indices.add(index)
            new_id = replacement(rng)
            masked_ids[index] = token_ids[index] if new_id is None else new_id
            masked.append((index, token_ids[index]))
    masked.sort()
    return masked_ids, [position for position, _ in masked], [label for _, label in masked]


@functools.cache
def _ngram_cdf(max_ngram: int) -> list[float]:
    """The CDF `RandomState.choice` builds for P(n) proportional to 1/n, n = 1..max_ngram."""
    sizes = np.arange(max_ngram, dtype=np.int64) + 1
    probabilities = 1.0 / sizes
    probabilities = probabilities / probabilities.sum(keepdims=True)
    cdf = probabilities.cumsum()
    cdf /= cdf[-1]
    return cdf.tolist()


def continuation_ids(tokenizer: MegatronTokenizer) -> frozenset[int]:
    """The ids whose WordPiece token continues a word ("##..."), as Megatron tests it."""
    return frozenset(token_id for token_id, token in tokenizer.inv_vocab.items() if token.startswith("##"))


# ---------------------------------------------------------------- the dataset base


class MaskedWordPieceDataset(torch.utils.data.Dataset, abc.ABC):
    """Samples of whole sentences of one split's documents; subclasses turn them into BERT/T5 samples.

    `documents` are this split's document ids (consecutive); `num_samples` None means one epoch.
    `cache_dir` None builds the sample index without caching it.
    """

    def __init__(
        self,
        sequences: IndexedDataset,
        dataset_path: str | None,
        documents: np.ndarray,
        num_samples: int | None,
        split: Split,
        config: MaskedDatasetConfig,
        cache_dir: str | None,
    ) -> None:
        self.sequences = sequences
        self.dataset_path = dataset_path
        self.documents = np.asarray(documents, dtype=np.int64)
        if len(self.documents) == 0 or np.any(np.diff(self.documents) != 1):
            raise ValueError(f"{dataset_path}: the {split.name} split needs a non-empty run of documents")
        self.num_samples = num_samples
        self.split = split
        self.config = config
        self.document_indices = np.asarray(
            sequences.document_indices[np.append(self.documents, self.documents[-1] + 1)], dtype=np.int64
        )
        first, last = int(self.document_indices[0]), int(self.document_indices[-1])
        lengths = np.ascontiguousarray(sequences.sequence_lengths[first:last])
        self.unique_identifiers = {
            "class": type(self).__name__,
            "dataset_path": dataset_path,
            "num_samples": num_samples,
            "index_split": split.name,
            "random_seed": config.seed,
            "sequence_length": config.seq_length,
            "split": config.split,
            "short_sequence_probability": config.short_sequence_probability,
            "min_sentences": self.min_sentences(),
            # Which documents, and their sentence lengths: data rewritten under the same path gets new indices.
            "documents_md5": hashlib.md5(self.document_indices.tobytes() + lengths.tobytes()).hexdigest(),
        }
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        arrays = load_or_build_indices(
            cache_dir,
            self.unique_description,
            f"{type(self).__name__}-{split.name}",
            ("sample_index",),
            self._build_sample_index,
        )
        self.sample_index = arrays["sample_index"]
        self.continuation_ids = continuation_ids(config.tokenizer)

    @staticmethod
    def num_elements(sequences: IndexedDataset) -> int:
        """What --split divides: documents (a sample never crosses one)."""
        return len(sequences.document_indices) - 1

    @abc.abstractmethod
    def max_target_length(self) -> int:
        """Tokens of text a sample may hold: the sequence length less the special tokens added."""

    @abc.abstractmethod
    def min_sentences(self) -> int:
        """The fewest sentences a sample needs."""

    def _build_sample_index(self) -> dict[str, np.ndarray]:
        # With a sample count, Megatron builds as many whole epochs as reach it.
        num_epochs = 1 if self.num_samples is None else np.iinfo(np.int32).max - 1
        max_num_samples = UINT32_MAX if self.num_samples is None else self.num_samples
        sample_index = build_sentence_sample_index(
            self.document_indices,
            self.sequences.sequence_lengths,
            num_epochs,
            max_num_samples,
            self.max_target_length(),
            self.config.short_sequence_probability,
            self.config.seed,
            self.min_sentences(),
        )
        logger.info("%s %s: %d samples", type(self).__name__, self.split.name, len(sample_index))
        return {"sample_index": sample_index}

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    def sample_sentences(self, idx: int) -> tuple[list[list[int]], int, np.random.RandomState]:
        """Sample `idx`'s sentences, its target length and its own random state (Megatron's seeding)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {type(self).__name__} of {len(self)} samples")
        first, end, target_length = (int(value) for value in self.sample_index[idx])
        sentences = [self.sequences[i].tolist() for i in range(first, end)]
        return sentences, target_length, np.random.RandomState(seed=(self.config.seed + idx) % 2**32)
