"""Megatron's pretraining sampler and data loader: sequential micro-batches, resumable at any sample.

Global batch k takes samples [consumed + k * mbs * dp, consumed + (k + 1) * mbs * dp); data parallel
rank r reads its slice [r * mbs, (r + 1) * mbs) of it. A run resumed with the checkpoint's
`consumed_samples` therefore continues with exactly the batches the uninterrupted run would have read.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


class MegatronPretrainingSampler:
    """Batch sampler yielding this rank's micro-batch index lists, starting after `consumed_samples`."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to consume: the dataset has {total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} leaves nothing of the {total_samples} samples; the "
                "run has already read the whole dataset (train for more samples or fewer iterations)"
            )
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be > 0, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data parallel rank {data_parallel_rank} is not in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Micro-batches this rank yields (Megatron returns total_samples here; a DataLoader wants this)."""
        full, partial = divmod(
            self.total_samples - self.consumed_samples, self.micro_batch_times_data_parallel_size
        )
        return full + int(partial > 0 and not self.drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_times_data_parallel_size
        rank_offset = self.data_parallel_rank * self.micro_batch_size
        for batch_start in range(self.consumed_samples, self.total_samples, step):
            batch_end = min(batch_start + step, self.total_samples)
            if batch_end - batch_start < step and self.drop_last:
                return
            # The rank's slice of the global batch; may be short or empty in a partial last batch, as in Megatron.
            begin = min(batch_start + rank_offset, batch_end)
            yield list(range(begin, min(begin + self.micro_batch_size, batch_end)))


def collate(items: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack the samples' arrays key by key into [micro_batch, ...] tensors."""
    return {key: torch.from_numpy(np.stack([item[key] for item in items])) for key in items[0]}


def build_pretraining_data_loader(
    dataset: torch.utils.data.Dataset | None,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
) -> torch.utils.data.DataLoader | None:
    """A DataLoader over `dataset` yielding this rank's micro-batches as dicts of tensors (None for None)."""
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )
