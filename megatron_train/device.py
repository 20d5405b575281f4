"""Which device and collective backend this process uses: CUDA + NCCL when present, else CPU + gloo.

Code elsewhere asks here instead of calling `.cuda()`, so every module runs on a CPU-only machine.
"""

from __future__ import annotations

import os

import torch


def get_device() -> torch.device:
    """The current CUDA device when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_backend() -> str:
    """The torch.distributed backend matching `get_device()`: nccl on CUDA, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def set_device_for_local_rank() -> torch.device:
    """Bind this process to GPU `$LOCAL_RANK` (set by torchrun) when CUDA is available; return the device."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return get_device()
