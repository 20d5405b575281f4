"""Tensor, sequence and pipeline parallel building blocks (Megatron-Core's `tensor_parallel` and `parallel_state`)."""

from megatron_train.parallel.config import ParallelConfig
from megatron_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_train.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
)
from megatron_train.parallel.random import checkpoint, get_rng_tracker, model_parallel_seed

__all__ = [
    "ColumnParallelLinear",
    "ParallelConfig",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "checkpoint",
    "get_rng_tracker",
    "model_parallel_seed",
    "vocab_parallel_cross_entropy",
]
