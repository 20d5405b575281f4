"""Mixed-precision optimizer with fp32 main params, fp16 loss scaling and global-norm clipping."""

from megatron_train.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_train.optimizer.optimizer import MegatronOptimizer, get_megatron_optimizer, get_param_groups

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "MegatronOptimizer",
    "get_megatron_optimizer",
    "get_param_groups",
]
