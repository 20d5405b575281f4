"""The peak FLOP/s of a device, for MFU; a step's model FLOPs are its family's terms' (`models.terms`)."""

from __future__ import annotations

import torch

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
