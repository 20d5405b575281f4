"""Mixed-precision optimizer with fp32 main params, fp16 loss scaling and global-norm clipping; its
distributed variant shards main params and optimizer states over the data-parallel group."""

from __future__ import annotations

import torch

from megatron_train.distributed.ddp import unwrap_model
from megatron_train.optimizer.distrib_optimizer import DistributedOptimizer, chunk_named_parameters
from megatron_train.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_train.optimizer.optimizer import MegatronOptimizer, get_param_groups
from megatron_train.training.config import OptimizerConfig


def get_megatron_optimizer(
    config: OptimizerConfig,
    model: torch.nn.Module | list[torch.nn.Module],
    params_dtype: torch.dtype = torch.float32,
    use_distributed_optimizer: bool = False,
) -> MegatronOptimizer:
    """One optimizer over `model`'s parameters, named as in the unwrapped module's state dict.

    `model` is a module or its data-parallel wrapper, or a list of them (the model chunks of virtual pipeline
    stages: params named `<chunk>.<name>`). `use_distributed_optimizer` needs each chunk in the local DDP
    built with `DDPConfig(use_distributed_optimizer=True)`.
    """
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    if use_distributed_optimizer:
        return DistributedOptimizer(chunks, config, params_dtype)
    named_params = chunk_named_parameters([unwrap_model(chunk) for chunk in chunks])
    return MegatronOptimizer(named_params, config, params_dtype)


__all__ = [
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "MegatronOptimizer",
    "chunk_named_parameters",
    "get_megatron_optimizer",
    "get_param_groups",
]
