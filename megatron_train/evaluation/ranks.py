"""Zero-shot evaluation split over ranks, as Megatron's tasks/zeroshot_gpt runs it under torchrun.

Each data-parallel replica scores its share of the windows (or examples); every rank of a replica runs the same
batches on its TP slice of its pipeline stage (`inference.forward.forward_step`), so only the last stage has the
losses; the sums are then added over the replicas from the last stage's first TP rank and handed to every rank.
Without model-parallel groups (one process) each function is the single-process answer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_train.device import get_device
from megatron_train.parallel import state


def data_parallel_share(count: int) -> range:
    """The indices (of `count` windows or examples) this rank's data-parallel replica scores."""
    return range(state.get_data_parallel_rank(), count, state.get_data_parallel_world_size())


def holds_results() -> bool:
    """This rank's scores count: the last pipeline stage's first TP rank (the other TP ranks hold copies)."""
    return state.is_pipeline_last_stage() and state.get_tensor_model_parallel_rank() == 0


def sum_over_replicas(values: list[float]) -> list[float]:
    """`values` (sums this replica's last stage scored; ignored on the other ranks) added over the data-parallel
    replicas, on every rank. float64, so counts and loss sums stay exact enough to match one process."""
    if not state.model_parallel_is_initialized():
        return values
    tensor = torch.tensor(values if holds_results() else [0.0] * len(values), dtype=torch.float64)
    tensor = tensor.to(get_device())
    dist.all_reduce(tensor)
    return tensor.tolist()


def is_reporting_rank() -> bool:
    """Rank 0 prints results and progress bars (every rank computes them)."""
    return not dist.is_initialized() or dist.get_rank() == 0
