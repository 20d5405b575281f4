"""Catch SIGTERM (a scheduler's "you are about to be killed") so the loop can save and exit cleanly."""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from megatron_train.device import get_device


class DistributedSignalHandler:
    """Records that a signal arrived; `signals_received()` is true on every rank if any rank got one."""

    def __init__(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.sig = sig
        self.received = False
        self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def __enter__(self) -> DistributedSignalHandler:
        self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(self.sig, self._previous)

    def signals_received(self) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=get_device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
