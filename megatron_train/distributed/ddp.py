"""Data parallel as Megatron-Core does it: one contiguous gradient buffer, split into buckets whose
all-reduces start during backward as soon as every grad in the bucket is ready.

Each param gets `param.main_grad`, a view into the buffer; a post-accumulate-grad hook adds the fresh
`.grad` into it and frees `.grad`. On the last micro-batch (outside `no_sync()`), a bucket that becomes
complete is averaged over the data-parallel group with an async all-reduce (`overlap_grad_reduce`), or
all buckets are reduced at `finish_grad_sync()` (no overlap). This buffer is what a distributed optimizer
later shards (reduce-scatter instead of all-reduce).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_BUCKET_SIZE = 40_000_000


@dataclass
class DDPConfig:
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    bucket_size: int | None = None  # elements; None: max(40M, 1M * DP) as in Megatron


class Bucket:
    """A slice of the grad buffer holding whole params; reduced with one collective."""

    def __init__(self, params: list[torch.nn.Parameter], data: torch.Tensor) -> None:
        self.params = params
        self.data = data
        self.pending: set[torch.nn.Parameter] = set(params)
        self.handle: dist.Work | None = None
        self.launched = False

    def reset(self) -> None:
        self.pending = set(self.params)
        self.handle = None
        self.launched = False


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module`; grads land in `param.main_grad` already averaged over `data_parallel_group`."""

    def __init__(
        self, module: torch.nn.Module, config: DDPConfig, data_parallel_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.group = data_parallel_group
        self.dp_size = dist.get_world_size(data_parallel_group) if dist.is_initialized() else 1
        bucket_size = config.bucket_size or max(DEFAULT_BUCKET_SIZE, 1_000_000 * self.dp_size)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buffers_by_dtype: dict[torch.dtype, torch.Tensor] = {}
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[torch.nn.Parameter, Bucket] = {}
        for dtype in dict.fromkeys(self._grad_dtype(p) for p in params):
            # Reverse order: roughly the order in which backward produces the grads.
            self._build_buffer(
                dtype, [p for p in reversed(params) if self._grad_dtype(p) == dtype], bucket_size
            )
        self.is_last_microbatch = True
        self._broadcast_params()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _broadcast_params(self) -> None:
        """Start every DP replica from DP rank 0's weights (as Megatron's DDP does)."""
        if self.dp_size == 1:
            return
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for param in self.module.parameters():
            dist.broadcast(param.data, src=source, group=self.group)

    def _grad_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return torch.float32 if self.config.grad_reduce_in_fp32 else param.dtype

    def _build_buffer(self, dtype: torch.dtype, params: list[torch.nn.Parameter], bucket_size: int) -> None:
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel, dtype=dtype, device=params[0].device)
        self.buffers_by_dtype[dtype] = buffer
        offset, bucket_start, bucket_params = 0, 0, []
        for param in params:
            param.main_grad = buffer[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
            bucket_params.append(param)
            if offset - bucket_start >= bucket_size or param is params[-1]:
                bucket = Bucket(bucket_params, buffer[bucket_start:offset])
                self.buckets.append(bucket)
                self.bucket_of.update(dict.fromkeys(bucket_params, bucket))
                bucket_start, bucket_params = offset, []

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.config.overlap_grad_reduce and self.is_last_microbatch:
            bucket = self.bucket_of[param]
            bucket.pending.discard(param)
            if not bucket.pending:
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        if self.dp_size == 1:
            return
        bucket.data.div_(self.dp_size)
        bucket.handle = dist.all_reduce(
            bucket.data, group=self.group, async_op=self.config.overlap_grad_reduce
        )

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads without reducing them (all micro-batches but the last)."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def finish_grad_sync(self) -> None:
        """Reduce what backward did not start (unused params, no overlap) and wait for every bucket."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None and self.config.overlap_grad_reduce:
                bucket.handle.wait()
            bucket.reset()

    def zero_grad_buffer(self) -> None:
        for buffer in self.buffers_by_dtype.values():
            buffer.zero_()
        for bucket in self.buckets:
            bucket.reset()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class TorchDistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch's DDP (`--ddp-impl torch`) with the two calls the training loop makes on any DDP wrapper."""

    def finish_grad_sync(self) -> None:
        """torch's DDP has already reduced the grads when backward returns."""

    def zero_grad_buffer(self) -> None:
        """Grads live in `.grad`; the optimizer's zero_grad clears them."""


def wrap_data_parallel(
    module: torch.nn.Module, ddp_impl: str, config: DDPConfig, data_parallel_group: dist.ProcessGroup | None
) -> torch.nn.Module:
    """Wrap `module` with the chosen implementation (`local`: ours, `torch`: torch's DDP)."""
    if ddp_impl == "local":
        return DistributedDataParallel(module, config, data_parallel_group)
    if ddp_impl == "torch":
        if not dist.is_initialized():
            raise RuntimeError("--ddp-impl torch needs torch.distributed initialised (launch with torchrun)")
        return TorchDistributedDataParallel(
            module, process_group=data_parallel_group, broadcast_buffers=False
        )
    raise ValueError(f"--ddp-impl {ddp_impl!r}: choose local or torch")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a data-parallel wrapper (itself when unwrapped)."""
    while isinstance(model, DistributedDataParallel | torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model
