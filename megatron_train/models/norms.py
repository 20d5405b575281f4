"""LayerNorm and RMSNorm, chosen by `--normalization`."""

from __future__ import annotations

import torch
from torch import nn

from megatron_train.models.config import TransformerConfig


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back (as HF Llama, so weights port exactly)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def build_norm(config: TransformerConfig, sequence_parallel: bool) -> nn.Module:
    """The configured norm; under sequence parallelism its parameters are marked for the TP grad all-reduce."""
    dtype = config.params_dtype
    if config.normalization == "RMSNorm":
        norm = RMSNorm(config.hidden_size, eps=config.norm_epsilon, dtype=dtype)
    else:
        norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon, dtype=dtype)
    for param in norm.parameters():
        param.sequence_parallel = sequence_parallel
    return norm
