"""Which params count once in a global norm, reductions of statistics over the model-parallel ranks, clipping by
the global grad norm (Megatron's clip_grads.py), the zeros in the grads (count_zeros_fp32) and the global params
norm (Megatron's calc_params_l2_norm).

A statistic of the grads or params (a sum of squares, a count, an inf flag) is the sum or max of two parts: the
dense params', reduced over the TP x PP ranks of one model replica, and the MoE experts', reduced over the
ETP x EP x PP ranks that hold every expert once (Megatron-Core's chained dense and expert optimizers); each part is
the same on every data-parallel replica, so the result is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_train.device import get_device
from megatron_train.distributed.ddp import DataParallelGroup, is_expert_parameter
from megatron_train.parallel import state


def counts_towards_norm(param: torch.nn.Parameter) -> bool:
    """A param's grad enters the norm once: TP-replicated params only on TP rank 0, shared (tied) copies not;
    experts always (no two ranks of their reduction group hold the same expert slice)."""
    if getattr(param, "shared", False):
        return False
    if is_expert_parameter(param):
        return True
    return getattr(param, "tensor_model_parallel", False) or state.get_tensor_model_parallel_rank() == 0


# The data-parallel groups (dense, experts') whose ranks each hold a different part of the grads (the distributed
# optimizer's shards), or None when every data-parallel rank holds all of them.
ShardingGroups = tuple[DataParallelGroup, DataParallelGroup] | None


def all_reduce_grad_stat(
    dense: torch.Tensor, expert: torch.Tensor, op: dist.ReduceOp, sharded_over: ShardingGroups = None
) -> torch.Tensor:
    """dense (over TP x PP) op expert (over ETP x EP x PP), each first reduced over its data-parallel group of
    `sharded_over`."""
    groups = state.process_groups()
    for tensor, model_parallel, dp in (
        (dense, groups.mp, sharded_over and sharded_over[0]),
        (expert, groups.tp_ep_pp, sharded_over and sharded_over[1]),
    ):
        if dp and dp.size > 1:
            dist.all_reduce(tensor, op=op, group=dp.group)
        if state.group_size(model_parallel) > 1:
            dist.all_reduce(tensor, op=op, group=model_parallel)
    return dense + expert if op == dist.ReduceOp.SUM else torch.maximum(dense, expert)


def counted_sums(
    params: list[torch.nn.Parameter],
    tensors: list[torch.Tensor],
    measure: Callable[[list[torch.Tensor]], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`measure` of the dense params' tensors, of the experts') over the ones this rank counts
    (`counts_towards_norm`), as fp32 scalars."""
    totals = []
    for expert in (False, True):
        total = torch.zeros((), dtype=torch.float32, device=get_device())
        counted = [
            tensor
            for param, tensor in zip(params, tensors, strict=True)
            if counts_towards_norm(param) and is_expert_parameter(param) == expert
        ]
        if counted:
            total += measure(counted).to(total.device)
        totals.append(total)
    return totals[0], totals[1]


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm([t.float() for t in tensors])).pow(2).sum()


def zeros_count(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.numel() - torch.count_nonzero(t) for t in tensors]).sum().float()


def get_grad_norm_fp32(
    params: list[torch.nn.Parameter], grads: list[torch.Tensor], sharded_over: ShardingGroups = None
) -> float:
    """L2 norm of the whole model's gradient, computed in fp32 and identical on every rank (`sharded_over`: the
    data-parallel groups over which each rank holds its own part of the grads, as under the distributed
    optimizer)."""
    dense, expert = counted_sums(params, grads, sum_of_squares)
    return all_reduce_grad_stat(dense, expert, dist.ReduceOp.SUM, sharded_over).sqrt().item()


def count_zeros_fp32(
    params: list[torch.nn.Parameter], grads: list[torch.Tensor], sharded_over: ShardingGroups = None
) -> float:
    """Zero entries of the whole model's gradient (replicas once), reduced as the grad norm is."""
    dense, expert = counted_sums(params, grads, zeros_count)
    return all_reduce_grad_stat(dense, expert, dist.ReduceOp.SUM, sharded_over).item()


def params_l2_norm(modules: list[torch.nn.Module]) -> float:
    """L2 norm of the whole model's parameters (this rank's model chunks; dense params summed over TP x PP,
    experts over ETP x EP x PP, each replica once), computed in fp32 and identical on every rank."""
    params = [p for module in modules for p in module.parameters()]
    dense, expert = counted_sums(params, [p.detach() for p in params], sum_of_squares)
    return all_reduce_grad_stat(dense, expert, dist.ReduceOp.SUM).sqrt().item()


def clip_grads_by_total_norm(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale every grad in place so the global norm is at most `max_norm`."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)
