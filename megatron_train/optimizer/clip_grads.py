"""Which params count once in a global norm, reductions over the model-parallel ranks, clipping by the global grad
norm (Megatron's clip_grads.py) and the global params norm (Megatron's calc_params_l2_norm)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_train.device import get_device
from megatron_train.parallel import state


def counts_towards_norm(param: torch.nn.Parameter) -> bool:
    """A param's grad enters the norm once: TP-replicated params only on TP rank 0, shared (tied) copies not."""
    if getattr(param, "shared", False):
        return False
    return getattr(param, "tensor_model_parallel", False) or state.get_tensor_model_parallel_rank() == 0


def all_reduce_model_parallel(tensor: torch.Tensor, op: dist.ReduceOp) -> None:
    """Reduce over the model-parallel group (tensor x pipeline); a no-op when it has one rank."""
    model_parallel_size = (
        state.get_tensor_model_parallel_world_size() * state.get_pipeline_model_parallel_world_size()
    )
    if model_parallel_size > 1:
        dist.all_reduce(tensor, op=op, group=state.get_model_parallel_group())


def params_l2_norm(modules: list[torch.nn.Module]) -> float:
    """L2 norm of the whole model's parameters (this rank's model chunks, summed over TP x PP, each replica once),
    computed in fp32 and identical on every rank of the model-parallel group."""
    total = torch.zeros((), dtype=torch.float32, device=get_device())
    counted = [
        p.detach().float() for module in modules for p in module.parameters() if counts_towards_norm(p)
    ]
    if counted:
        total += torch.stack(torch._foreach_norm(counted)).pow(2).sum().to(total.device)
    all_reduce_model_parallel(total, dist.ReduceOp.SUM)
    return total.sqrt().item()


def clip_grads_by_total_norm(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale every grad in place so the global norm is at most `max_norm`."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)
