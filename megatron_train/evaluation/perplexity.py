"""Language-model loss over a long token stream, in windows, as Megatron's tasks/zeroshot_gpt scores it.

Windows of `seq_length` targets start every `overlapping_eval` tokens (default: seq_length, i.e. disjoint).
After the first window only the last `overlapping_eval` targets of each window are scored, so every target
token is scored exactly once, with up to seq_length - overlapping_eval tokens of extra context.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from megatron_train.evaluation.ranks import data_parallel_share, is_reporting_rank, sum_over_replicas
from megatron_train.inference.forward import forward_step
from storage.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)


def num_windows(num_tokens: int, seq_length: int, overlapping_eval: int | None) -> int:
    """How many windows cover num_tokens - 1 targets (Megatron's _LMDataset.total_sequences)."""
    stride = max(1, overlapping_eval or seq_length)
    targets = max(num_tokens - 1 - stride, 0)
    return max(math.ceil(targets / stride) + 1, 1)


def window(
    tokens: Sequence[int] | np.ndarray, index: int, seq_length: int, overlapping_eval: int | None, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Window `index`: seq_length + 1 tokens (padded with pad_id) and the loss mask of its seq_length targets."""
    stride = max(1, overlapping_eval or seq_length)
    start = index * stride
    ids = np.asarray(tokens[start : start + seq_length + 1], dtype=np.int64)
    padded = np.full(seq_length + 1, pad_id, dtype=np.int64)
    padded[: len(ids)] = ids
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    loss_mask[: max(len(ids) - 1, 0)] = 1.0
    if stride != seq_length and index != 0:
        loss_mask[:-stride] = 0.0  # targets the previous window already scored
    return padded, loss_mask


def _batches(
    tokens,
    windows: Sequence[int],
    seq_length: int,
    overlapping_eval: int | None,
    micro_batch_size: int,
    pad_id: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The `windows` (indices) in batches of micro_batch_size: (ids [b, seq_length + 1], loss mask [b, seq_length])."""
    for first in range(0, len(windows), micro_batch_size):
        batch = [
            window(tokens, index, seq_length, overlapping_eval, pad_id)
            for index in windows[first : first + micro_batch_size]
        ]
        yield (
            torch.from_numpy(np.stack([ids for ids, _ in batch])),
            torch.from_numpy(np.stack([mask for _, mask in batch])),
        )


@torch.inference_mode()
def sum_lm_loss(
    model: torch.nn.Module,
    tokens: Sequence[int] | np.ndarray,
    seq_length: int,
    overlapping_eval: int | None = None,
    micro_batch_size: int = 8,
    pad_id: int = 0,
) -> tuple[float, int]:
    """Sum of the per-token losses of every target in `tokens`, and how many targets were scored.

    `tokens` may be anything that slices to ids (a list, an array, an IndexedTokens stream). Under torchrun
    `model` is this rank's part and each data-parallel replica scores its share of the windows
    (`evaluation.ranks`); every rank returns the totals."""
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    model.eval()
    device = next(model.parameters()).device
    total_loss, scored, started = 0.0, 0, time.perf_counter()
    windows = data_parallel_share(num_windows(len(tokens), seq_length, overlapping_eval))
    batches = _batches(tokens, windows, seq_length, overlapping_eval, micro_batch_size, pad_id)
    num_batches = math.ceil(len(windows) / micro_batch_size)
    progress = tqdm(
        batches, total=num_batches, desc="evaluating", unit="batch", disable=not is_reporting_rank()
    )
    for ids, loss_mask in progress:
        ids, loss_mask = ids.to(device), loss_mask.to(device)
        position_ids = torch.arange(seq_length, device=device).expand(ids.size(0), -1)
        losses = forward_step(model, ids[:, :-1], position_ids, None, labels=ids[:, 1:])
        if losses is not None:  # the last pipeline stage
            total_loss += float((losses.double() * loss_mask).sum())
            scored += int(loss_mask.sum())
    total_loss, scored = sum_over_replicas([total_loss, scored])
    elapsed = time.perf_counter() - started
    logger.info("scored %d tokens in %.1f s (%.0f tokens/s)", scored, elapsed, scored / max(elapsed, 1e-9))
    return total_loss, int(scored)


class IndexedTokens:
    """The sequences of a Megatron .bin/.idx dataset as one token stream that slices lazily (memory-mapped)."""

    def __init__(self, dataset: IndexedDataset) -> None:
        self.dataset = dataset
        self.starts = np.concatenate([[0], np.cumsum(dataset.sequence_lengths, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, span: slice) -> np.ndarray:
        start, stop, _ = span.indices(len(self))
        parts = []
        sequence = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.starts[sequence + 1]))
            offset = start - int(self.starts[sequence])
            parts.append(self.dataset.get(sequence, offset=offset, length=end - start))
            start, sequence = end, sequence + 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass
class PerplexityResult:
    avg_loss: float
    ppl: float
    num_tokens: int

    def megatron_line(self, task: str = "VALID_PPL") -> str:
        return f" validation results on {task} | avg loss: {self.avg_loss:.4E} | ppl: {self.ppl:.4E} |"


def validation_perplexity(
    model: torch.nn.Module,
    data_prefix: str,
    seq_length: int,
    overlapping_eval: int | None = None,
    micro_batch_size: int = 8,
    max_tokens: int | None = None,
) -> PerplexityResult:
    """Perplexity of a tokenized dataset (`<prefix>.bin/.idx`), its sequences read back to back."""
    tokens = IndexedTokens(IndexedDataset(data_prefix))
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    if len(tokens) < 2:
        raise ValueError(f"{data_prefix}: the dataset has {len(tokens)} tokens; perplexity needs at least 2")
    total_loss, scored = sum_lm_loss(model, tokens, seq_length, overlapping_eval, micro_batch_size)
    avg_loss = total_loss / scored
    return PerplexityResult(avg_loss=avg_loss, ppl=math.exp(min(20.0, avg_loss)), num_tokens=scored)
