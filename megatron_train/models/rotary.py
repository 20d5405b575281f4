"""Rotary position embedding (RoPE) in the rotate-half convention of Megatron-Core and HF Llama.

A head vector's first rot_dim = kv_channels * rotary_percent dims are rotated, the rest pass through.
Within the rotated part, dim i pairs with dim i + rot_dim / 2 and turns by position * base^(-2i / rot_dim).
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Computes cos/sin tables for given position ids (any positions: training or a KV-cache offset)."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: int = 10000) -> None:
        super().__init__()
        self.rot_dim = int(kv_channels * rotary_percent)
        if self.rot_dim % 2:
            raise ValueError(f"rotary dims kv_channels * rotary_percent = {self.rot_dim} must be even")
        self.rotary_base = rotary_base

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [s, b, 1, rot_dim] in fp32, for position_ids [b, s]."""
        # Computed per call in fp32 (not a buffer), so casting the model to bf16 cannot degrade the frequencies.
        exponents = (
            torch.arange(0, self.rot_dim, 2, dtype=torch.float32, device=position_ids.device) / self.rot_dim
        )
        inv_freq = 1.0 / (self.rotary_base**exponents)
        freqs = position_ids.transpose(0, 1).float().unsqueeze(-1) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)
        return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [s, b, heads, d]'s first cos.shape[-1] dims; computed in fp32, returned in x's dtype."""
    rot_dim = cos.shape[-1]
    rotated, passed = x[..., :rot_dim].float(), x[..., rot_dim:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat((rotated.to(x.dtype), passed), dim=-1)
