"""Rotary position embedding (RoPE) in the rotate-half convention of Megatron-Core and HF Llama.

A head vector's first rot_dim = kv_channels * rotary_percent dims are rotated, the rest pass through.
Within the rotated part, dim i pairs with dim i + rot_dim / 2 and turns by position * base^(-2i / rot_dim).
With --use-rope-scaling those frequencies are scaled as Llama-3.1 scales them (`llama3_scaled_frequencies`).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Computes cos/sin tables for given position ids (any positions: training or a KV-cache offset)."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling_factor: float | None = None,
    ) -> None:
        super().__init__()
        self.rot_dim = int(kv_channels * rotary_percent)
        if self.rot_dim % 2:
            raise ValueError(f"rotary dims kv_channels * rotary_percent = {self.rot_dim} must be even")
        self.rotary_base = rotary_base
        self.rope_scaling_factor = rope_scaling_factor

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [s, b, 1, rot_dim] in fp32, for position_ids [b, s]."""
        # Computed per call in fp32 (not a buffer), so casting the model to bf16 cannot degrade the frequencies.
        exponents = (
            torch.arange(0, self.rot_dim, 2, dtype=torch.float32, device=position_ids.device) / self.rot_dim
        )
        inv_freq = 1.0 / (self.rotary_base**exponents)
        if self.rope_scaling_factor is not None:
            inv_freq = llama3_scaled_frequencies(inv_freq, self.rope_scaling_factor)
        freqs = position_ids.transpose(0, 1).float().unsqueeze(-1) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)
        return angles.cos(), angles.sin()


def llama3_scaled_frequencies(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_context: int = 8192,
) -> torch.Tensor:
    """Llama-3.1's scaling (Megatron's --use-rope-scaling, HF's rope_type "llama3"): wavelengths longer than
    the original context / low_freq_factor slow down by `factor`, shorter than context / high_freq_factor
    stay, and the band between blends the two."""
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original_context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original_context / high_freq_factor) & (
        wavelength <= original_context / low_freq_factor
    )
    return torch.where(medium, blended, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [s, b, heads, d]'s first cos.shape[-1] dims; computed in fp32, returned in x's dtype."""
    rot_dim = cos.shape[-1]
    rotated, passed = x[..., :rot_dim].float(), x[..., rot_dim:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat((rotated.to(x.dtype), passed), dim=-1)
