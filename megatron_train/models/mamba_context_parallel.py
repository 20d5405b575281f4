"""Context parallelism for the Mamba mixer (Megatron-Core's MambaContextParallel): trade the sequence split for a
head split around the convolution and the scan, which run along the whole sequence.

Under `--context-parallel-size C` each rank holds its two chunks of every sequence (`parallel.context_parallel`:
chunks r and 2C - 1 - r). After the in-projection an all-to-all over the CP group gives each rank the WHOLE
sequence for 1/C of this TP rank's heads and groups (its share of each of z, x, B, C and dt); the chunks are put
back in sequence order, so the causal convolution and the selective scan run unchanged (document restarts from
the whole sequence's ids). After the gated norm the inverse reorder and all-to-all return every rank its chunks
with all heads for the out-projection. The mixer's per-channel parameters (convolution, dt_bias, A_log, D, the
norm's weight) are used as this rank's share (`rank_slice`); their gradients, zero outside it, are summed over
the CP group with the other replicated parameters' (the data x context parallel reduction).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_train.parallel.context_parallel import all_rank_indices, heads_to_sequence, sequence_to_heads
from megatron_train.parallel.layers import slice_for_rank


def shares_by_rank(x: torch.Tensor, part_sizes: Sequence[int], cp_size: int) -> torch.Tensor:
    """[b, s, sum(parts)] -> [b, s, C, sum(parts) / C]: slot j holds CP rank j's share of every part (its
    heads of z, x and dt, its groups of B and C), the parts in order."""
    parts = x.split(list(part_sizes), dim=-1)
    return torch.cat([part.unflatten(-1, (cp_size, -1)) for part in parts], dim=-1)


def to_sequence_order(gathered: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[b, S, ...] in the order of the ranks' chunks (rank 0's two, rank 1's two, ...) -> positions 0 .. S - 1."""
    order = all_rank_indices(gathered.shape[1], cp_size, gathered.device)
    return gathered[:, torch.argsort(order)]


def to_rank_order(x: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The inverse of `to_sequence_order`."""
    return x[:, all_rank_indices(x.shape[1], cp_size, x.device)]


class MambaContextParallel:
    """The exchanges of one mixer over `group` (two ranks or more); `part_sizes`: the widths of z, x, B, C and dt
    of this TP rank, each a multiple of the group's size."""

    def __init__(self, group: dist.ProcessGroup, part_sizes: Sequence[int]) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.part_sizes = tuple(part_sizes)

    def to_heads(self, zxbcdt: torch.Tensor) -> torch.Tensor:
        """[b, s, parts] (this rank's chunks, all heads) -> [b, S, parts / C] (the whole sequence in order, this
        rank's share of every part)."""
        shares = shares_by_rank(zxbcdt, self.part_sizes, self.size)
        gathered = sequence_to_heads(shares.contiguous(), self.group)  # [b, C s, 1, parts / C]
        return to_sequence_order(gathered.flatten(2), self.size)

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """[b, S, d / C] (whole sequence, this rank's heads) -> [b, s, d] (this rank's chunks, every rank's heads
        in order)."""
        shares = to_rank_order(y, self.size).unsqueeze(2).contiguous()
        return heads_to_sequence(shares, self.group).flatten(2)

    def rank_slice(self, tensor: torch.Tensor, part_sizes: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's share along dim 0 of a per-channel parameter (of each of its parts in turn)."""
        return slice_for_rank(tensor, 0, self.size, self.rank, partition_sizes=part_sizes)
