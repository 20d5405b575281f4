"""Build the train, valid and test datasets from DataConfig, as Megatron-Core's BlendedMegatronDatasetBuilder.

One builder serves GPT (`build_train_valid_test_datasets`) and the masked-LM kinds BERT and T5
(`build_masked_train_valid_test_datasets`, the kind chosen by the type of its config). For `--data-path`,
every dataset's elements (sequences for GPT, documents for BERT/T5) are cut into train/valid/test ranges
by `--split`; a weighted blend asks each dataset for its share of the samples plus Megatron's 0.5% surplus
and blends them with BlendedDataset. `--train-data-path` etc. give each split its own blend, used whole.
Under torch.distributed, rank 0 builds (and caches) the indices first; the other ranks then load them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from megatron_train.data.bert_dataset import BERTDataset, BERTDatasetConfig
from megatron_train.data.blended import BlendedDataset
from megatron_train.data.config import Blend, DataConfig, parse_split, split_bounds, split_matrix
from megatron_train.data.gpt_dataset import GPTDataset, GPTDatasetConfig, Split
from megatron_train.data.indices import load_or_build_indices, normalize_weights
from megatron_train.data.masked_dataset import MaskedDatasetConfig, MaskedWordPieceDataset
from megatron_train.data.mock import MockGPTDataset
from megatron_train.data.t5_dataset import T5Dataset, T5DatasetConfig
from storage.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

MID_LEVEL_DATASET_SURPLUS = 0.005  # Megatron's margin: each blended dataset builds 0.5% more than its share
MOCK_SPLIT = "1,1,1"  # Megatron splits its mock data evenly
SCAN_TOKENS = 1 << 24  # tokens per step of the scan of a .bin's token ids

T = TypeVar("T")
Datasets = tuple[
    torch.utils.data.Dataset | None, torch.utils.data.Dataset | None, torch.utils.data.Dataset | None
]
MASKED_DATASET_KINDS: dict[type[MaskedDatasetConfig], type[MaskedWordPieceDataset]] = {
    BERTDatasetConfig: BERTDataset,
    T5DatasetConfig: T5Dataset,
}


def build_train_valid_test_datasets(
    data_config: DataConfig,
    seq_length: int,
    train_valid_test_num_samples: tuple[int | None, int | None, int | None],
    seed: int,
    tokenizer_eod: int,
    vocab_size: int | None = None,
) -> Datasets:
    """(train, valid, test) datasets of `seq_length`-token samples; a split is None when it has no data
    or 0 samples are asked of it (None samples: one epoch). `vocab_size` (the tokenizer's) bounds the token ids
    of the data (checked as each dataset is opened) and of --mock-data.
    """
    config = GPTDatasetConfig(
        seq_length=seq_length,
        seed=seed,
        eod=tokenizer_eod,
        split=data_config.split,
        reset_position_ids=data_config.reset_position_ids,
        reset_attention_mask=data_config.reset_attention_mask,
        eod_mask_loss=data_config.eod_mask_loss,
    )
    if data_config.mock_data:
        return _build_mock(config, train_valid_test_num_samples, vocab_size)  # nothing cached: no ordering
    if not any(data_config.blends()):
        raise ValueError("no data: give --data-path (or --train-data-path ...), or --mock-data")
    builder = _SplitBuilder(data_config, GPTDataset, config, vocab_size)
    return _rank_zero_first(lambda: builder.build(train_valid_test_num_samples))


def build_masked_train_valid_test_datasets(
    data_config: DataConfig,
    config: BERTDatasetConfig | T5DatasetConfig,
    train_valid_test_num_samples: tuple[int | None, int | None, int | None],
) -> Datasets:
    """(train, valid, test) BERT or T5 datasets (by the type of `config`) from sentence-split data,
    blended and split as for GPT; a split is None when it has no data or 0 samples are asked of it."""
    if data_config.mock_data:
        raise ValueError("--mock-data makes GPT samples only; give BERT/T5 a sentence-split --data-path")
    if not any(data_config.blends()):
        raise ValueError("no data: give --data-path (or --train-data-path ...) of --split-sentences data")
    config = replace(config, split=data_config.split)
    builder = _SplitBuilder(
        data_config, MASKED_DATASET_KINDS[type(config)], config, config.tokenizer.vocab_size
    )
    return _rank_zero_first(lambda: builder.build(train_valid_test_num_samples))


def _build_mock(
    config: GPTDatasetConfig, num_samples: tuple[int | None, ...], vocab_size: int | None
) -> Datasets:
    config = replace(config, split=MOCK_SPLIT)
    bookends = split_matrix(parse_split(MOCK_SPLIT))
    return tuple(
        None
        if num_samples[split.value] == 0
        else MockGPTDataset(num_samples[split.value], split, config, bookends[split.value], vocab_size)
        for split in Split
    )


class _SplitBuilder:
    """Opens each dataset prefix once and builds the `dataset_class`/blended dataset of every split."""

    def __init__(
        self,
        data_config: DataConfig,
        dataset_class: type[GPTDataset] | type[MaskedWordPieceDataset],
        config: GPTDatasetConfig | MaskedDatasetConfig,
        vocab_size: int | None,
    ) -> None:
        self.data_config = data_config
        self.vocab_size = vocab_size
        self.dataset_class = dataset_class
        self.blends = data_config.blends()
        if data_config.data_path:
            self.config = config
            self.bookends = split_matrix(parse_split(data_config.split))
        else:  # one blend per split, each used whole
            self.config = replace(config, split="per-split data paths")
            self.bookends = [(0.0, 1.0) if blend else None for blend in self.blends]
        self._sequences: dict[str, IndexedDataset] = {}

    def build(self, num_samples: tuple[int | None, ...]) -> Datasets:
        datasets = []
        for split in Split:
            blend, bookend, size = (
                self.blends[split.value],
                self.bookends[split.value],
                num_samples[split.value],
            )
            if blend is None or bookend is None or size == 0:
                datasets.append(None)
            else:
                datasets.append(self._build_split(blend, split, bookend, size))
        return tuple(datasets)

    def _build_split(
        self, blend: Blend, split: Split, bookend: tuple[float, float], size: int | None
    ) -> torch.utils.data.Dataset:
        prefixes = blend.prefixes
        if len(prefixes) == 1:
            return self._dataset(prefixes[0], split, bookend, size)
        cache_dir = self._cache_dir(prefixes[0])
        if blend.weights is None:  # weigh each dataset by its one-epoch size
            datasets = [self._dataset(prefix, split, bookend, None) for prefix in prefixes]
            lengths = [len(dataset) for dataset in datasets]
            total = sum(lengths) if size is None else min(size, sum(lengths))
            return BlendedDataset(datasets, lengths, total, cache_dir)
        if size is None:
            raise ValueError(
                f"the {split.name} blend has weights, so it needs a sample count; give the number of samples"
            )
        weights = normalize_weights(blend.weights).tolist()
        targets = [math.ceil(size * weight) for weight in weights]
        datasets = [
            self._dataset(prefix, split, bookend, math.ceil(target * (1 + MID_LEVEL_DATASET_SURPLUS)))
            for prefix, target in zip(prefixes, targets, strict=True)
        ]
        return BlendedDataset(datasets, weights, sum(targets), cache_dir)

    def _dataset(
        self, prefix: str, split: Split, bookend: tuple[float, float], num_samples: int | None
    ) -> GPTDataset | MaskedWordPieceDataset:
        if prefix not in self._sequences:
            self._sequences[prefix] = IndexedDataset(prefix)
            check_token_ids(self._sequences[prefix], self.vocab_size, self._cache_dir(prefix))
        sequences = self._sequences[prefix]
        num_elements = self.dataset_class.num_elements(sequences)
        elements = "sequences" if self.dataset_class is GPTDataset else "documents"
        begin, end = split_bounds(bookend, num_elements)
        if begin == end:
            raise ValueError(
                f"{prefix}: --split {self.data_config.split} leaves the {split.name} split no {elements} "
                f"(range [{begin}, {end}) of {num_elements}); give it a larger share in --split, or a 0 share "
                "to skip it (e.g. --split 90,10,0 has no test split)"
            )
        documents = np.arange(begin, end, dtype=np.int32)
        return self.dataset_class(
            sequences, prefix, documents, num_samples, split, self.config, self._cache_dir(prefix)
        )

    def _cache_dir(self, prefix: str) -> str:
        """--data-cache-path, else `cache/` beside the data, else a temporary directory."""
        if self.data_config.data_cache_path:
            return self.data_config.data_cache_path
        beside_data = os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")
        if _is_writable_dir(beside_data):
            return beside_data
        fallback = os.path.join(tempfile.gettempdir(), "megatron_flow_index_cache")
        logger.warning("%s is not writable; caching dataset indices in %s", beside_data, fallback)
        return fallback


def check_token_ids(sequences: IndexedDataset, vocab_size: int | None, cache_dir: str | None) -> None:
    """Every token id of the data lies in the tokenizer's vocabulary, checked when the dataset is built (one scan
    of the .bin, cached beside the dataset indices) instead of an IndexError in the embedding at the first step:
    data tokenized with another tokenizer is an error naming the file, the document and the id."""
    if vocab_size is None:
        return
    path = os.path.abspath(sequences.path_prefix) + ".bin"
    stat = os.stat(path)
    description = json.dumps(
        {"class": "TokenIdRange", "path": path, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    )
    tokens = sequences.all_tokens()

    def scan() -> dict[str, np.ndarray]:
        low, high = 0, -1
        for start in range(0, tokens.size, SCAN_TOKENS):
            chunk = tokens[start : start + SCAN_TOKENS]
            low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
        return {"token_id_range": np.array([low, high], dtype=np.int64)}

    arrays = load_or_build_indices(cache_dir, description, "TokenIdRange", ("token_id_range",), scan)
    low, high = (int(value) for value in arrays["token_id_range"])
    if low >= 0 and high < vocab_size:
        return
    bad = _first_outside(tokens, vocab_size)
    sequence = sequences.sequence_at(bad)
    document = int(np.searchsorted(sequences.document_indices, sequence, side="right")) - 1
    raise ValueError(
        f"{path}: document {document} (sequence {sequence}) holds token id {int(tokens[bad])}, outside the "
        f"tokenizer's {vocab_size} ids: the data was tokenized with another tokenizer; tokenize it again with this "
        "one, or pass the tokenizer flags it was made with"
    )


def _first_outside(tokens: np.ndarray, vocab_size: int) -> int:
    """The position of the first token id outside [0, vocab_size) (one is known to be there)."""
    for start in range(0, tokens.size, SCAN_TOKENS):
        chunk = tokens[start : start + SCAN_TOKENS]
        outside = np.flatnonzero((chunk < 0) | (chunk >= vocab_size))
        if outside.size:
            return start + int(outside[0])
    raise AssertionError("the scan found an id outside the vocabulary, this pass none")


def _is_writable_dir(directory: str) -> bool:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def _rank_zero_first(build: Callable[[], T]) -> T:
    """Run `build` on rank 0, then on the others (which then find rank 0's cache) when distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return build()
    if dist.get_rank() == 0:
        try:
            return build()
        finally:
            dist.barrier()
    dist.barrier()
    return build()
