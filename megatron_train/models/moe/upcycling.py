"""Upcycling (Megatron's --moe-use-upcycling): an MoE model started from a dense checkpoint, every expert of a layer
a copy of that layer's dense MLP (granularity 1), so the MoE model computes what the dense one did until the
experts drift apart; the router starts at its own initialisation (Komatsuzaki et al., 2022)."""

from __future__ import annotations

import torch

# expert weight (under `mlp.`) -> (the dense MLP tensor under `mlp.` it copies, whether it is transposed)
UPCYCLED = {
    "experts.weight1": ("linear_fc1.weight", True),
    "experts.weight2": ("linear_fc2.weight", True),
    "experts.bias1": ("linear_fc1.bias", False),
    "experts.bias2": ("linear_fc2.bias", False),
}


def dense_source(name: str) -> tuple[str, bool] | None:
    """(the dense checkpoint tensor an expert weight `name` is made from, transposed?), or None for a name that is
    no expert weight."""
    for expert, (dense, transposed) in UPCYCLED.items():
        if name.endswith(".mlp." + expert):
            return name.removesuffix(expert) + dense, transposed
    return None


def upcycle(dense: torch.Tensor, transposed: bool, num_experts: int) -> torch.Tensor:
    """All `num_experts` experts' global tensor from the dense MLP's (a Linear's [out, in] becomes the experts'
    [in, out] layout; SwiGLU's [gate; up] rows stay in that order along the experts' last axis)."""
    weight = dense.t() if transposed else dense
    return weight.unsqueeze(0).expand(num_experts, *weight.shape).contiguous()
