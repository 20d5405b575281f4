"""Comparing tensor-parallel shards with one process's tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_train.parallel import state


def full_tensor(local: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """All-gather a TP-sharded tensor to its full shape using the param's partition_dim and partition_stride."""
    world_size = state.get_tensor_model_parallel_world_size()
    if not getattr(param, "tensor_model_parallel", False) or world_size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(shards, local.contiguous(), group=state.get_tensor_model_parallel_group())
    dim, stride = param.partition_dim, param.partition_stride
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[rank][s] for s in range(stride) for rank in range(world_size)], dim=dim)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over max |expected|."""
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()
