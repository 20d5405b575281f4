"""Megatron's weight initialisations: normal(0, std), and std / sqrt(2 * layers) for projections into the
residual stream."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def init_method_normal(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tensor: nn.init.normal_(tensor, mean=0.0, std=std)


def scaled_init_method_normal(std: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Megatron's init for projections feeding the residual stream: std / sqrt(2 * num_layers)."""
    return init_method_normal(std / (2.0 * num_layers) ** 0.5)
