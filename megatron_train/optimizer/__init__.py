"""Mixed-precision optimizer with fp32 main params, fp16 loss scaling and global-norm clipping; its
distributed variant shards main params and optimizer states over the data-parallel group."""

from __future__ import annotations

import torch

from megatron_train.distributed.ddp import unwrap_model
from megatron_train.optimizer.distrib_optimizer import DistributedOptimizer
from megatron_train.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_train.optimizer.optimizer import MegatronOptimizer, get_param_groups
from megatron_train.training.config import OptimizerConfig


def get_megatron_optimizer(
    config: OptimizerConfig,
    model: torch.nn.Module,
    params_dtype: torch.dtype = torch.float32,
    use_distributed_optimizer: bool = False,
) -> MegatronOptimizer:
    """The optimizer over `model`'s parameters, named as in the unwrapped module's state dict.

    `model` may be the module or its data-parallel wrapper; `use_distributed_optimizer` needs the local DDP
    built with `DDPConfig(use_distributed_optimizer=True)`.
    """
    if use_distributed_optimizer:
        return DistributedOptimizer(model, config, params_dtype)
    return MegatronOptimizer(list(unwrap_model(model).named_parameters()), config, params_dtype)


__all__ = [
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "MegatronOptimizer",
    "get_megatron_optimizer",
    "get_param_groups",
]
