"""Fast numpy builders for the GPT document, sample and shuffle indices and the blending indices.

Each function returns exactly what Megatron-Core's `gpt_dataset.py`, `helpers.cpp::build_sample_idx`
and `helpers.cpp::build_blending_indices` return for the same inputs (same RandomState draws, same
dtypes), so a Megatron user sees the same samples in the same order. The sequential C++ loops are
replaced by vectorised numpy: a cumulative sum for the sample index, and a segmented simulation
for the greedy blending order (see `build_blending_indices`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable

import numpy as np

from storage.atomic import atomic_path, atomic_write_text

logger = logging.getLogger(__name__)

INT32_MAX = np.iinfo(np.int32).max


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int) -> int:
    """Megatron's `_get_num_epochs`: the fewest epochs (>= 1) whose tokens cover `num_samples` samples."""
    if num_samples is None:
        return 1
    tokens_requested = num_samples * seq_length + extra
    return max(1, -(-tokens_requested // tokens_per_epoch))


def separate_final_epoch_split(
    tokens_per_epoch: int, num_epochs: int, num_samples: int, seq_length: int, extra: int
) -> int | None:
    """Megatron's rule: shuffle the last epoch apart when it contributes < 80% of an epoch's samples.

    Returns the number of samples before the final epoch when it is kept apart, else None.
    """
    if num_epochs == 1:
        return None
    num_samples_sans_final_epoch = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    num_samples_from_final_epoch = num_samples - num_samples_sans_final_epoch
    num_samples_per_epoch = (tokens_per_epoch - extra) // seq_length
    assert 0 <= num_samples_from_final_epoch <= num_samples_per_epoch + 1
    if num_samples_from_final_epoch < int(0.80 * num_samples_per_epoch):
        return num_samples_sans_final_epoch
    return None


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """`num_epochs` copies of `documents` (int32), shuffled; the final epoch apart when asked."""
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(document_index)
    return document_index


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
    chunk_size: int = 1 << 20,
) -> np.ndarray:
    """Megatron's `build_sample_idx`: [num_samples + 1, 2] (position in `document_index`, token offset).

    The documents of `document_index` are laid end to end; sample i covers tokens
    [i * seq_length, (i + 1) * seq_length + extra). Row i is where token i * seq_length lies, named as
    Megatron names it: the document holding token `i * seq_length + extra - 1`, and the offset of
    `i * seq_length` from that document's start. Rows are computed from cumulative document ends,
    `chunk_size` documents at a time so the temporaries stay small.
    """
    extra = int(add_extra_token_to_sequence)
    total_tokens = num_epochs * tokens_per_epoch
    if drop_last_partial_sequence:
        num_samples = (total_tokens - extra) // seq_length
    else:
        num_samples = -(-(total_tokens - extra) // seq_length)
    dtype = np.int32 if max(len(document_index), int(sequence_lengths.max())) <= INT32_MAX else np.int64

    sample_index = np.empty((num_samples + 1, 2), dtype=dtype)
    sample_index[0] = 0
    row, tokens_before, rows_before = 1, 0, 0
    for begin in range(0, len(document_index), chunk_size):
        lengths = sequence_lengths[document_index[begin : begin + chunk_size]].astype(np.int64)
        ends = np.cumsum(lengths)
        ends += tokens_before
        # Rows 1..num_samples whose named token lies before each document's end: non-decreasing.
        rows_before_end = (ends - extra) // seq_length
        np.clip(rows_before_end, 0, num_samples, out=rows_before_end)
        rows_per_document = np.diff(rows_before_end, prepend=rows_before)
        documents = np.repeat(np.arange(len(lengths)), rows_per_document)
        rows = slice(row, row + len(documents))
        sample_index[rows, 0] = documents + begin
        sample_index[rows, 1] = np.arange(rows.start, rows.stop, dtype=np.int64) * seq_length - (
            ends[documents] - lengths[documents]
        )
        row, tokens_before, rows_before = rows.stop, int(ends[-1]), int(rows_before_end[-1])
    if tokens_before != total_tokens:
        raise ValueError(
            f"document index holds {tokens_before} tokens, expected {num_epochs} epochs x "
            f"{tokens_per_epoch} tokens = {total_tokens}"
        )
    # The partial last sample (drop_last_partial_sequence=False) runs out of tokens: Megatron names
    # the last document and its last token but `extra`.
    last = len(document_index) - 1
    sample_index[row:, 0] = last
    sample_index[row:, 1] = sequence_lengths[document_index[last]] - extra
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def normalize_weights(weights) -> np.ndarray:
    """Weights divided by their sum, in float64, as Megatron's `utils.normalize` computes them."""
    w = np.asarray(weights, dtype=np.float64)
    return w / np.sum(w)


def _greedy_blend(
    weights: np.ndarray, counts: np.ndarray, start: np.ndarray, steps: int, out: np.ndarray | None
) -> None:
    """Advance independent copies of Megatron's greedy blend by `steps` samples, in place.

    Row r starts at sample `start[r]` with per-dataset `counts[r]`; each step gives the sample to the
    dataset with the largest error `weight * max(n, 1) - count` (first one on ties), as the C++ does.
    """
    rows = np.arange(len(start))
    n = start.astype(np.float64)
    for t in range(steps):
        errors = np.maximum(n, 1.0)[:, None] * weights - counts
        chosen = errors.argmax(axis=1)
        counts[rows, chosen] += 1
        if out is not None:
            out[:, t] = chosen
        n += 1.0


def build_blending_indices(
    weights, size: int, segment_length: int | None = None, warmup: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy error-minimising blend: (dataset_index int16[size], dataset_sample_index int64[size]).

    The greedy loop is sequential, so it is simulated in many segments at once: each segment starts
    from a guessed state (the nearest integer counts), warms up for `warmup` samples, and then records
    its choices. The greedy forgets a wrong start within a few samples, and the result is exact, not
    approximate: every segment's starting counts are checked against the true counts at the end of the
    segment before it, and any segment that started from a wrong guess is run again from the true one
    until all agree.
    """
    w = normalize_weights(weights)
    num_datasets = len(w)
    if not 0 < num_datasets < 32767:
        raise ValueError(f"blending needs 1 to 32766 datasets, got {num_datasets}")
    if size == 0:
        return np.zeros(0, dtype=np.int16), np.zeros(0, dtype=np.int64)
    if segment_length is None:
        segment_length = max(256, -(-size // 4096))
    num_segments = -(-size // segment_length)
    warmup = min(warmup, segment_length)  # so every segment but the first warms up from sample >= 0
    starts = np.arange(num_segments, dtype=np.int64) * segment_length

    # Guess each segment's starting counts from a point `warmup` samples earlier, then warm up.
    warm = np.maximum(starts - warmup, 0)
    floor_counts = np.floor(warm[:, None] * w).astype(np.int64)
    shortfall = warm - floor_counts.sum(axis=1)
    remainders = warm[:, None] * w - floor_counts
    rank = np.argsort(np.argsort(-remainders, axis=1, kind="stable"), axis=1, kind="stable")
    start_counts = floor_counts + (rank < shortfall[:, None])
    _greedy_blend(w, start_counts, warm, warmup, None)
    start_counts[0] = 0  # the first segment needs no guess: it starts from zero counts

    choices = np.empty((num_segments, segment_length), dtype=np.int16)
    todo = np.arange(num_segments)
    while len(todo):
        counts = start_counts[todo].copy()
        segment_choices = np.empty((len(todo), segment_length), dtype=np.int16)
        _greedy_blend(w, counts, starts[todo], segment_length, segment_choices)
        choices[todo] = segment_choices
        end_counts = start_counts + _counts_per_segment(choices, num_datasets)
        wrong = np.nonzero((start_counts[1:] != end_counts[:-1]).any(axis=1))[0] + 1
        start_counts[wrong] = end_counts[wrong - 1]
        todo = wrong

    dataset_index = choices.reshape(-1)[:size].copy()
    return dataset_index, _rank_within_dataset(dataset_index, num_datasets)


def _counts_per_segment(choices: np.ndarray, num_datasets: int) -> np.ndarray:
    """How many samples each segment (row of `choices`) gives to each dataset."""
    num_segments, segment_length = choices.shape
    cells = np.arange(num_segments, dtype=np.int64)[:, None] * num_datasets + choices
    counts = np.bincount(cells.reshape(-1), minlength=num_segments * num_datasets)
    return counts.reshape(num_segments, num_datasets)


def _rank_within_dataset(dataset_index: np.ndarray, num_datasets: int) -> np.ndarray:
    """For each sample, how many earlier samples went to the same dataset (its sample index there)."""
    order = np.argsort(dataset_index, kind="stable")
    first_of_dataset = np.concatenate(([0], np.cumsum(np.bincount(dataset_index, minlength=num_datasets))))
    sample_index = np.empty(len(dataset_index), dtype=np.int64)
    sample_index[order] = np.arange(len(dataset_index)) - first_of_dataset[dataset_index[order]]
    return sample_index


def load_or_build_indices(
    cache_dir: str | None,
    description: str,
    kind: str,
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """The index arrays `names`, loaded from `cache_dir` when an earlier run saved them, else built.

    Files are `<md5 of description>-<kind>-<name>.npy` (Megatron's `unique_description` scheme).
    Each is written under a temporary name and renamed, and the description file goes last, so a
    cache entry is complete exactly when its description exists. Loaded arrays are memory-mapped.
    """
    if cache_dir is None:
        return _timed_build(kind, build)
    base = os.path.join(cache_dir, f"{hashlib.md5(description.encode('utf-8')).hexdigest()}-{kind}")
    paths = {name: f"{base}-{name}.npy" for name in names}
    description_path = f"{base}-description.txt"
    if all(os.path.isfile(path) for path in [description_path, *paths.values()]):
        logger.info("%s indices loaded from cache %s", kind, base)
        return {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
    arrays = _timed_build(kind, build)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for name, path in paths.items():
            with atomic_path(path, fsync=False) as tmp, open(tmp, "wb") as file:
                np.save(file, arrays[name], allow_pickle=False)
        atomic_write_text(description_path, description, fsync=False)
    except OSError as error:
        raise OSError(
            f"cannot write the {kind} index cache under {cache_dir}: {error}; set --data-cache-path to a "
            "writable directory"
        ) from error
    return arrays


def _timed_build(kind: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    began = time.perf_counter()
    arrays = build()
    logger.info("%s indices built in %.3f s", kind, time.perf_counter() - began)
    return arrays
