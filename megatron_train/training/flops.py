"""Model FLOPs per step (Megatron's `num_floating_point_operations`) and the peak FLOP/s of a device."""

from __future__ import annotations

import torch

from megatron_train.models.config import TransformerConfig

# Dense bf16/fp16 tensor-core peaks (TFLOP/s, without sparsity) from the vendors' data sheets.
PEAK_TFLOPS_BY_GPU_NAME = {
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "A10": 125.0,
    "L4": 121.0,
    "V100": 125.0,
}


def num_floating_point_operations(
    config: TransformerConfig, padded_vocab_size: int, batch_size: int
) -> float:
    """Forward + backward FLOPs of one step on `batch_size` sequences (3x forward; Megatron's formula with
    GQA, SwiGLU and the logit layer; causal attention counted in full, as Megatron does)."""
    seq, hidden, layers = config.seq_length, config.hidden_size, config.num_layers
    heads = config.num_attention_heads
    query_groups = config.num_query_groups if config.group_query_attention else heads
    query_projection_ratio = config.kv_channels * heads / hidden
    gated_linear_multiplier = 3 / 2 if config.swiglu else 1
    attention = (1 + query_groups / heads + seq / hidden) * query_projection_ratio
    mlp = config.ffn_hidden_size / hidden * gated_linear_multiplier
    logit = padded_vocab_size / (2 * layers * hidden)
    return 12 * batch_size * seq * layers * hidden * hidden * (attention + mlp + logit)


def peak_flops_per_device(override_tflops: float | None = None) -> float | None:
    """FLOP/s one device can reach: `--peak-flops` (TFLOP/s) if given, else from the GPU's name; None on CPU."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_TFLOPS_BY_GPU_NAME.items():
        if key in name:
            return tflops * 1e12
    return None
