"""Data-parallel wrappers: ours (contiguous grad buffer, bucketed overlapped all-reduce) and torch's."""

from megatron_train.distributed.ddp import (
    DDPConfig,
    DistributedDataParallel,
    TorchDistributedDataParallel,
    unwrap_model,
    wrap_data_parallel,
)
from megatron_train.distributed.finalize_model_grads import finalize_model_grads

__all__ = [
    "DDPConfig",
    "DistributedDataParallel",
    "TorchDistributedDataParallel",
    "finalize_model_grads",
    "unwrap_model",
    "wrap_data_parallel",
]
