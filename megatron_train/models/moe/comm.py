"""The token dispatchers' collectives over any process group, as autograd functions: all-to-all with per-rank
split sizes, and all-gather / reduce-scatter along the first dimension with equal or per-rank sizes (each the
other's adjoint). Variable sizes go through all_to_all_single, which gloo and NCCL both take with uneven splits.

`ALL_TO_ALL_BYTES` counts the bytes this process sent to other ranks through `all_to_all` (forward and backward),
which `benchmarks/moe.py` compares with the dispatcher's closed form.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Newer torch names for all_gather_into_tensor / reduce_scatter_tensor (same arguments).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

ALL_TO_ALL_BYTES = [0]


def _world(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_to_all(
    group: dist.ProcessGroup, x: torch.Tensor, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    me = dist.get_rank(group)
    row_bytes = x[0:1].numel() * x.element_size()
    ALL_TO_ALL_BYTES[0] += (sum(input_splits) - input_splits[me]) * row_bytes
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _all_to_all(group, x, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return None, _all_to_all(ctx.group, grad, ctx.input_splits, ctx.output_splits), None, None


def all_to_all(
    group: dist.ProcessGroup | None, x: torch.Tensor, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """Rank r sends rows input_splits[j] (in order) to rank j and receives output_splits[j] rows from rank j."""
    if _world(group) == 1:
        return x
    return _AllToAll.apply(group, x, output_splits, input_splits)


def _gather(group: dist.ProcessGroup, x: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    """Every rank's `x` concatenated in rank order; `sizes[j]` rows from rank j (None: all equal)."""
    world = dist.get_world_size(group)
    if sizes is None:
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=group)
        return out
    out = x.new_empty((sum(sizes), *x.shape[1:]))
    dist.all_to_all_single(
        out, x.repeat(world, *[1] * (x.dim() - 1)), sizes, [x.shape[0]] * world, group=group
    )
    return out


def _reduce_scatter(group: dist.ProcessGroup, x: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    """The sum over ranks of each rank's rows of `x` that belong to this rank (`sizes[j]` rows for rank j, in
    rank order; None: equal parts)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if sizes is None:
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        _reduce_scatter_single(out, x.contiguous(), group=group)
        return out
    out = x.new_empty((world * sizes[me], *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), [sizes[me]] * world, sizes, group=group)
    return out.view(world, sizes[me], *x.shape[1:]).sum(dim=0)


class _GatherAlongFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather(group, x, sizes)

    @staticmethod
    def backward(ctx, grad):
        return None, _reduce_scatter(ctx.group, grad, ctx.sizes), None


class _ReduceScatterAlongFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter(group, x, sizes)

    @staticmethod
    def backward(ctx, grad):
        return None, _gather(ctx.group, grad, ctx.sizes), None


def gather_along_first_dim(
    group: dist.ProcessGroup | None, x: torch.Tensor, sizes: list[int] | None = None
) -> torch.Tensor:
    """All-gather along the first dimension (`sizes`: rows per rank when they differ); the gradient is
    reduce-scattered back."""
    if _world(group) == 1:
        return x
    return _GatherAlongFirstDim.apply(group, x, sizes)


def reduce_scatter_along_first_dim(
    group: dist.ProcessGroup | None, x: torch.Tensor, sizes: list[int] | None = None
) -> torch.Tensor:
    """Sum over the group and keep this rank's rows (`sizes`: rows per rank when they differ); the gradient is
    all-gathered back."""
    if _world(group) == 1:
        return x
    return _ReduceScatterAlongFirstDim.apply(group, x, sizes)
