"""Context parallelism's layout of a sequence and its communication (Megatron-Core's context parallel).

Each sequence of S tokens is cut into 2 x CP chunks of S / (2 CP) tokens; context-parallel rank r holds chunks r
and 2 CP - 1 - r, in that order (causal load balance: under a causal mask an early chunk attends to few keys and a
late one to many, so every rank gets one of each and the same work). Megatron's `get_batch_on_this_cp_rank`
does the same cut; `slice_batch` applies it to a micro-batch, keeping the document ids of the whole sequence,
which attention needs to mask keys held by other ranks.

The collectives here carry keys and values between the ranks of the context-parallel group: the ring's
point-to-point exchange (counted in `cp_p2p_counters`, as the pipeline's p2p is, for the communication volumes
`benchmarks/communication.py` and the planner check), the all-gather of keys and values along the sequence
(its gradient reduce-scattered back) and the all-to-all that trades a sequence split for a head split. See
docs/architecture.md (context parallelism).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from megatron_train.parallel import state
from megatron_train.parallel.mappings import gather_from_sequence_parallel_region
from megatron_train.parallel.p2p import P2PCounters

# Tensors of a micro-batch that are [b, S] token arrays cut along the sequence; the document ids stay whole.
SLICED_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
cp_p2p_counters = P2PCounters()  # bytes the ring attention sent and received since the last reset()


def chunk_indices(
    seq_length: int, cp_size: int, cp_rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """The global positions (0 .. S - 1) of the tokens context-parallel rank `cp_rank` holds, in its order:
    chunk cp_rank, then chunk 2 cp_size - 1 - cp_rank."""
    if seq_length % (2 * cp_size):
        raise ValueError(
            f"--seq-length {seq_length} is not divisible by 2 x --context-parallel-size {cp_size}: each sequence "
            f"is cut into {2 * cp_size} equal chunks; pick a sequence length that is a multiple of {2 * cp_size}"
        )
    size = seq_length // (2 * cp_size)
    first, second = cp_rank * size, (2 * cp_size - 1 - cp_rank) * size
    return torch.cat(
        [torch.arange(first, first + size, device=device), torch.arange(second, second + size, device=device)]
    )


def slice_batch(
    batch: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """This context-parallel rank's part of a micro-batch: `SLICED_KEYS` cut to its two chunks along the
    sequence (dim 1), everything else (the whole sequence's `document_ids`) as it is. Identity with one rank."""
    cp_size = state.group_size(group)
    if cp_size == 1:
        return dict(batch)
    sliced = {}
    for key, value in batch.items():
        if key in SLICED_KEYS:
            index = chunk_indices(value.shape[1], cp_size, state.group_rank(group), value.device)
            value = value.index_select(1, index)
        sliced[key] = value
    return sliced


def all_rank_indices(seq_length: int, cp_size: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of the tokens of every rank, rank 0's first: the order of a sequence gathered over
    the context-parallel group."""
    return torch.cat([chunk_indices(seq_length, cp_size, rank, device) for rank in range(cp_size)])


class RingExchange:
    """One step of the ring: send a tensor to the next context-parallel rank and receive the same shape from the
    previous one, without waiting (isend/irecv posted together, Megatron-Core's batched p2p). `wait()` returns the
    received tensor. `tag` keeps two exchanges in flight between the same pair apart (gloo matches on tags)."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup, tag: int) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.received = torch.empty_like(tensor)
        send = tensor.contiguous()
        ops = [
            dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group, tag),
            dist.P2POp(dist.irecv, self.received, dist.get_global_rank(group, (rank - 1) % size), group, tag),
        ]
        self.requests = dist.batch_isend_irecv(ops)
        nbytes = send.numel() * send.element_size()
        cp_p2p_counters.bytes_sent += nbytes
        cp_p2p_counters.bytes_received += nbytes

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.received


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, s, ...] of every context-parallel rank concatenated along the sequence, rank 0's first; the gradient
    is reduce-scattered back (all_gather's adjoint)."""
    gathered = gather_from_sequence_parallel_region(x.transpose(0, 1).contiguous(), True, group)
    return gathered.transpose(0, 1)


class _SequenceToHeads(torch.autograd.Function):
    """All-to-all [b, s, heads, d] (a sequence part, all heads) -> [b, cp * s, heads / cp, d] (every rank's
    sequence part, rank 0's first; this rank's heads), DeepSpeed-Ulysses' exchange; the backward is the inverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    """The inverse of `_SequenceToHeads`: [b, cp * s, heads / cp, d] -> [b, s, heads, d]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _sequence_to_heads(grad, ctx.group), None


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    b, s, heads, d = x.shape
    parts = x.reshape(b, s, size, heads // size, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp, b, s, h/cp, d]
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=group)  # received[j]: rank j's sequence part, my heads
    return received.permute(1, 0, 2, 3, 4).reshape(b, size * s, heads // size, d)


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    b, total, heads, d = x.shape
    parts = x.reshape(b, size, total // size, heads, d).transpose(0, 1).contiguous()  # [cp, b, s, h/cp, d]
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=group)  # received[j]: my sequence part, rank j's heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, total // size, size * heads, d)


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """See `_SequenceToHeads`; `heads` must divide by the group's size."""
    return _SequenceToHeads.apply(x, group)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """See `_HeadsToSequence`."""
    return _HeadsToSequence.apply(x, group)
