"""Data-parallel wrappers: ours (contiguous grad buffer, bucketed overlapped all-reduce) and torch's."""

from megatron_train.distributed.ddp import (
    DDPConfig,
    DistributedDataParallel,
    TorchDistributedDataParallel,
    unwrap_model,
    wrap_data_parallel,
)

__all__ = [
    "DDPConfig",
    "DistributedDataParallel",
    "TorchDistributedDataParallel",
    "unwrap_model",
    "wrap_data_parallel",
]
