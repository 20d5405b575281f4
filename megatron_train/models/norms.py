"""LayerNorm and RMSNorm, chosen by `--normalization`; `--apply-layernorm-1p` stores their weight zero-centred.

With `--apply-layernorm-1p` (Megatron-Core's `layernorm_zero_centered_gamma`) the stored weight is gamma - 1,
initialised to 0, and the forward scales by 1 + weight: the same function as a plain norm with weight gamma,
but weight decay pulls gamma towards 1 instead of 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.parallel.param_init import initialized, new_parameter


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back (as HF Llama, so weights port exactly)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        dtype: torch.dtype = torch.float32,
        zero_centered_gamma: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        initial = nn.init.zeros_ if zero_centered_gamma else nn.init.ones_
        self.weight = new_parameter((hidden_size,), dtype, initial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return weight * normed.to(x.dtype)


class LayerNorm1P(nn.LayerNorm):
    """LayerNorm whose stored weight is gamma - 1 (Megatron's `--apply-layernorm-1p`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hidden_size, eps=eps, dtype=dtype)
        initialized(self.weight, nn.init.zeros_)
        initialized(self.bias, nn.init.zeros_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


def build_norm(config: TransformerConfig, sequence_parallel: bool) -> nn.Module:
    """The configured norm; under sequence parallelism its parameters are marked for the TP grad all-reduce."""
    dtype = config.params_dtype
    if config.normalization == "RMSNorm":
        norm = RMSNorm(
            config.hidden_size,
            eps=config.norm_epsilon,
            dtype=dtype,
            zero_centered_gamma=config.apply_layernorm_1p,
        )
    elif config.apply_layernorm_1p:
        norm = LayerNorm1P(config.hidden_size, eps=config.norm_epsilon, dtype=dtype)
    else:
        norm = nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon, dtype=dtype)
    for param in norm.parameters():
        param.sequence_parallel = sequence_parallel
    return norm
