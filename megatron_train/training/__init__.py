"""The training loop and its parts: configs, LR schedule, micro-batching, logging, FLOPs, signals."""

from megatron_train.training.config import (
    CheckpointConfig,
    LoggingConfig,
    OptimizerConfig,
    TokenizerConfig,
    TrainingConfig,
)

__all__ = ["CheckpointConfig", "LoggingConfig", "OptimizerConfig", "TokenizerConfig", "TrainingConfig"]
