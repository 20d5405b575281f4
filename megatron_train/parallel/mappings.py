"""The collectives of tensor and sequence parallelism as autograd functions, named as in Megatron-Core.

Each forward collective has its adjoint as backward: copy <-> all-reduce, split <-> all-gather,
all-gather <-> reduce-scatter. Tensor-parallel splits are along the last (hidden) dimension;
sequence-parallel splits along the first dimension, the sequence in the [s, b, h] layout.
With one TP rank every function is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_train.parallel import state

# Recent torch renamed the single-tensor collectives (deprecating the old names); both take (output, input).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


Group = dist.ProcessGroup | None


def _reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if state.group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_along_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    world_size = state.group_size(group)
    if world_size == 1:
        return x
    if x.shape[-1] % world_size:
        raise ValueError(
            f"last dimension {x.shape[-1]} is not divisible by tensor parallel size {world_size}"
        )
    return x.chunk(world_size, dim=-1)[state.group_rank(group)].contiguous()


def _split_along_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    world_size = state.group_size(group)
    if world_size == 1:
        return x
    if x.shape[0] % world_size:
        raise ValueError(
            f"sequence length {x.shape[0]} is not divisible by tensor parallel size {world_size}; "
            "sequence parallelism needs --seq-length to be a multiple of --tensor-model-parallel-size"
        )
    return x.chunk(world_size, dim=0)[state.group_rank(group)].contiguous()


def _gather_along_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    world_size = state.group_size(group)
    if world_size == 1:
        return x
    out = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def _gather_along_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    gathered = _gather_along_first_dim(x.movedim(-1, 0), group)
    return gathered.movedim(0, -1).contiguous()


def _reduce_scatter_along_first_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    world_size = state.group_size(group)
    if world_size == 1:
        return x
    if x.shape[0] % world_size:
        raise ValueError(
            f"sequence length {x.shape[0]} is not divisible by tensor parallel size {world_size}"
        )
    out = torch.empty((x.shape[0] // world_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_last_dim(grad, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_first_dim(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tensor_parallel_output_grad, group):
        ctx.tensor_parallel_output_grad, ctx.group = tensor_parallel_output_grad, group
        return _gather_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        # Feeding a TP region, each rank holds a partial gradient of the full sequence: sum and keep our shard.
        # Feeding replicated computation, each rank holds the full gradient: just keep our shard.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad, ctx.group), None, None
        return _split_along_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_first_dim(grad, ctx.group), None


# Each function takes the tensor-parallel `group` it communicates over (a layer's, from its model's
# ProcessGroupCollection); None: parallel.state's (`tensor_group_or_default`).


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient (input of a column-parallel layer)."""
    return _CopyToModelParallelRegion.apply(x, state.tensor_group_or_default(group))


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-reduce forward (output of a row-parallel layer); identity backward."""
    return _ReduceFromModelParallelRegion.apply(x, state.tensor_group_or_default(group))


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; all-gather the gradient."""
    return _ScatterToModelParallelRegion.apply(x, state.tensor_group_or_default(group))


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-gather along the last dimension; split the gradient."""
    return _GatherFromModelParallelRegion.apply(x, state.tensor_group_or_default(group))


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Keep this rank's slice of the sequence (first) dimension; all-gather the gradient."""
    return _ScatterToSequenceParallelRegion.apply(x, state.tensor_group_or_default(group))


def gather_from_sequence_parallel_region(
    x: torch.Tensor, tensor_parallel_output_grad: bool = True, group: Group = None
) -> torch.Tensor:
    """All-gather along the sequence; reduce-scatter the gradient (or split it, see the backward)."""
    return _GatherFromSequenceParallelRegion.apply(
        x, tensor_parallel_output_grad, state.tensor_group_or_default(group)
    )


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sum across TP and keep this rank's sequence slice (output of a row-parallel layer); all-gather back."""
    return _ReduceScatterToSequenceParallelRegion.apply(x, state.tensor_group_or_default(group))
