"""Tensor-parallel layers (Megatron-Core's ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding).

Each rank allocates only its shard of a split weight and draws it from its TP rank's tracked RNG stream
(Megatron's `_initialize_affine_weight_gpu`; on the meta device until `param_init.materialize`); under
--use-cpu-initialization it builds the full master weight from the CPU generator and keeps its slice
(Megatron's `_initialize_affine_weight_cpu`): with the same seed, a TP=N model then holds exactly the TP=1
model's weights, split (`parallel_weight`). Sharded parameters carry `tensor_model_parallel=True`, `partition_dim`
and `partition_stride`, or `partition_sizes` when the dim packs parts of different sizes (Mamba's fused
in-projection [z, x, B, C, dt]: each part is split over TP on its own, as Megatron-Core's `partition_sizes`);
replicated parameters that see only a sequence shard under sequence parallelism carry
`sequence_parallel=True`, and their gradients are summed over TP by `allreduce_sequence_parallel_grads`.
Each layer communicates over the tensor-parallel group it is given (`tp_group`, from its model's
ProcessGroupCollection); none given, over parallel.state's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_train.parallel import state
from megatron_train.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron_train.parallel.param_init import new_parameter
from megatron_train.parallel.random import full_weight_initialization

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, with an error naming `what` when it does not divide."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor model parallel size ({denominator}); "
            "pick a --tensor-model-parallel-size that divides it"
        )
    return numerator // denominator


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, partition_dim: int, stride: int = 1, partition_sizes: Sequence[int] | None = None
) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    if partition_sizes is not None:
        param.partition_sizes = tuple(partition_sizes)


def part_sizes(length: int, stride: int = 1, partition_sizes: Sequence[int] | None = None) -> list[int]:
    """The parts a partitioned dim of `length` packs, each split over TP on its own: `partition_sizes`, or
    `stride` equal parts (a SwiGLU fc1 [gate; up] has stride 2)."""
    if partition_sizes is None:
        return [length // stride] * stride
    if sum(partition_sizes) != length:
        raise ValueError(f"partition sizes {list(partition_sizes)} do not add up to the dim's {length}")
    return list(partition_sizes)


def rank_pieces(
    length: int,
    tp_size: int,
    tp_rank: int,
    stride: int = 1,
    partition_sizes: Sequence[int] | None = None,
    what: str = "partitioned weight dimension",
) -> list[tuple[int, int]]:
    """(start, length) along the partitioned dim of each piece TP rank `tp_rank` holds, in order: its share of
    every part (with stride s: chunks r, r + TP, ... of TP * s equal chunks)."""
    pieces, start = [], 0
    for size in part_sizes(length, stride, partition_sizes):
        share = divide(size, tp_size, what)
        pieces.append((start + tp_rank * share, share))
        start += size
    return pieces


def slice_for_rank(
    tensor: torch.Tensor,
    dim: int,
    tp_size: int,
    tp_rank: int,
    stride: int = 1,
    partition_sizes: Sequence[int] | None = None,
    what: str = "partitioned weight dimension",
) -> torch.Tensor:
    """TP rank `tp_rank`'s slice of a whole tensor split along `dim` (see `rank_pieces`)."""
    pieces = rank_pieces(tensor.shape[dim], tp_size, tp_rank, stride, partition_sizes, what)
    return torch.cat([tensor.narrow(dim, start, size) for start, size in pieces], dim=dim).contiguous()


def merge_rank_slices(
    shards: Sequence[torch.Tensor], dim: int, stride: int = 1, partition_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """The whole tensor from every TP rank's slice, in rank order (inverse of `slice_for_rank`)."""
    tp_size = len(shards)
    sizes = part_sizes(shards[0].shape[dim] * tp_size, stride, partition_sizes)
    per_rank = [shard.split([size // tp_size for size in sizes], dim=dim) for shard in shards]
    return torch.cat([pieces[part] for part in range(len(sizes)) for pieces in per_rank], dim=dim)


def parallel_weight(
    full_shape: tuple[int, ...],
    partition_dim: int,
    stride: int,
    init_method: InitMethod,
    dtype: torch.dtype,
    tp_group: dist.ProcessGroup | None = None,
    partition_sizes: Sequence[int] | None = None,
) -> nn.Parameter:
    """This rank's shard of a weight split along `partition_dim`: its share of each of the `stride` equal parts,
    or of each of `partition_sizes` (`rank_pieces`; a SwiGLU fc1 [gate; up] gives each rank [gate_r; up_r]). Drawn
    as a shard from the TP rank's tracked stream, or under --use-cpu-initialization as the full weight on the CPU
    sliced as `split_tp_shard` cuts checkpoints (module docstring).
    """
    tp_group = state.tensor_group_or_default(tp_group)
    world_size, rank = state.group_size(tp_group), state.group_rank(tp_group)
    if full_weight_initialization():
        master = torch.empty(full_shape, dtype=torch.float32, device="cpu")
        init_method(master)
        local = slice_for_rank(master, partition_dim, world_size, rank, stride, partition_sizes)
        weight = nn.Parameter(local.to(dtype))
    else:
        pieces = rank_pieces(full_shape[partition_dim], world_size, rank, stride, partition_sizes)
        local_shape = list(full_shape)
        local_shape[partition_dim] = sum(size for _, size in pieces)
        # split over several ranks: each draws its shard from its own tracked stream (one rank: the default one)
        weight = new_parameter(local_shape, dtype, init_method, tensor_parallel=world_size > 1)
    set_tensor_model_parallel_attributes(weight, partition_dim, stride, partition_sizes)
    return weight


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split along its output columns: each rank computes Y's slice [..., out / TP].

    Input is [s, b, in] (full sequence), or [s / TP, b, in] under sequence parallelism, all-gathered here.
    `gather_output=True` all-gathers Y to full width; otherwise the output stays split for a following
    RowParallelLinear. `weight` passed to forward replaces the layer's own (tied output layer).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        init_method: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        partition_sizes: Sequence[int] | None = None,
        sequence_parallel: bool = False,
        skip_weight_param_allocation: bool = False,
        params_dtype: torch.dtype = torch.float32,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.tp_group = state.tensor_group_or_default(tp_group)
        self.output_size_per_partition = divide(output_size, state.group_size(self.tp_group), "output size")
        self.weight = (
            None
            if skip_weight_param_allocation
            else parallel_weight(
                (output_size, input_size),
                0,
                stride,
                init_method,
                params_dtype,
                self.tp_group,
                partition_sizes,
            )
        )
        self.bias = None
        if bias:
            self.bias = new_parameter((self.output_size_per_partition,), params_dtype, nn.init.zeros_)
            set_tensor_model_parallel_attributes(self.bias, 0, stride, partition_sizes)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if weight is None:
            raise ValueError("this ColumnParallelLinear holds no weight (tied output layer): pass weight=")
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, group=self.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        y = F.linear(x, weight, self.bias)
        return gather_from_tensor_model_parallel_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split along its input rows: each rank multiplies its slice of X, then sum over TP.

    The sum is an all-reduce, or a reduce-scatter along the sequence under sequence parallelism
    (output [s / TP, b, out]). The bias is added once, after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        init_method: InitMethod,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel needs input_is_parallel=True")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.tp_group = state.tensor_group_or_default(tp_group)
        self.input_size_per_partition = divide(input_size, state.group_size(self.tp_group), "input size")
        self.weight = parallel_weight(
            (output_size, input_size), 1, 1, init_method, params_dtype, self.tp_group
        )
        self.bias = None
        if bias:
            self.bias = new_parameter((output_size,), params_dtype, nn.init.zeros_)
            self.bias.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        if state.group_size(self.tp_group) == 1:  # nothing to reduce: the GEMM adds the bias
            return F.linear(x, self.weight, self.bias)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            y = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: each rank looks up the ids in its range, zeros the rest,
    and the partial embeddings are summed over TP. With `weights_in_fp32` a half-precision table is looked up
    (and summed over TP) in fp32, so its gradient accumulates the repeats of a token in fp32 before the one
    rounding to the table's dtype (Megatron's --embedding-weights-in-fp32)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod,
        params_dtype: torch.dtype = torch.float32,
        tp_group: dist.ProcessGroup | None = None,
        weights_in_fp32: bool = False,
    ) -> None:
        super().__init__()
        self.weights_in_fp32 = weights_in_fp32
        self.tp_group = state.tensor_group_or_default(tp_group)
        per_partition = divide(num_embeddings, state.group_size(self.tp_group), "padded vocabulary size")
        self.vocab_start_index = state.group_rank(self.tp_group) * per_partition
        self.vocab_end_index = self.vocab_start_index + per_partition
        self.weight = parallel_weight(
            (num_embeddings, embedding_dim), 0, 1, init_method, params_dtype, self.tp_group
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weights_in_fp32 else self.weight
        if state.group_size(self.tp_group) == 1:
            return F.embedding(input_ids, weight).to(self.weight.dtype)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local_ids, weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group).to(self.weight.dtype)


def allreduce_sequence_parallel_grads(model: nn.Module, tp_group: dist.ProcessGroup | None = None) -> None:
    """Sum over the TP group (`tp_group`, default parallel.state's) the gradients of parameters marked
    `sequence_parallel` (norm weights and row-parallel biases): each TP rank saw only its sequence shard. Call
    after backward, before the data-parallel reduction and the optimizer step. Uses `param.main_grad` (fp32
    gradient buffers) when set."""
    tp_group = state.tensor_group_or_default(tp_group)
    if state.group_size(tp_group) == 1:
        return
    marked = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    grads = [p.main_grad if hasattr(p, "main_grad") else p.grad for p in marked]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    for grad, reduced in zip(grads, torch.split(flat, [g.numel() for g in grads]), strict=True):
        grad.copy_(reduced.view_as(grad))
