"""Data parallel as Megatron-Core does it: one contiguous gradient buffer, split into buckets whose
all-reduces start during backward as soon as every grad in the bucket is ready.

Each param gets `param.main_grad`, a view into the buffer; a post-accumulate-grad hook adds the fresh
`.grad` into it and frees `.grad`. On the last micro-batch (outside `no_sync()`), a bucket that becomes
complete is averaged over the data-parallel group with an async all-reduce (`overlap_grad_reduce`), or
all buckets are reduced at `finish_grad_sync()` (no overlap).

With `use_distributed_optimizer` (Megatron's --use-distributed-optimizer) the params also live in one contiguous
buffer laid out like the grads, every bucket is padded to a multiple of the DP size, and DP rank r owns the
r-th equal part of each bucket: buckets are reduce-scattered into their owners' parts instead of all-reduced,
and after the optimizer updated its parts `all_gather_params()` gives every rank all the params again (with
`overlap_param_gather` asynchronously: each module's forward pre-hook waits only for the buckets holding its
params, so the gathers of later layers overlap the forward of earlier ones, as in Megatron-Core). The
word embedding tied across pipeline stages gets a bucket of its own (as in Megatron-Core), so both stages'
copies split the same way over DP and their grads can be summed after the reduce-scatter.

MoE experts (params marked `allreduce = False`, Megatron's mark) live in buffers of their own, reduced over the
expert-data-parallel group (the replicas of the same experts) instead of DP; their grads are scaled by 1 / DP, not
1 / expert DP, and summed: each expert has seen the tokens of every DP rank of its expert-parallel group, so the
sum over its replicas divided by DP is the mean over DP of the loss's gradient, as Megatron-Core's DDP does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_BUCKET_SIZE = 40_000_000

# Newer torch names for reduce_scatter_tensor / all_gather_into_tensor (same arguments); older torch has only those.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class DDPConfig:
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    bucket_size: int | None = None  # elements; None: max(40M, 1M * DP) as in Megatron
    use_distributed_optimizer: bool = False  # shard buckets over DP: reduce-scatter grads, all-gather params
    # Distributed optimizer: leave the param all-gather in flight until the next forward needs the params.
    overlap_param_gather: bool = False


@dataclass(frozen=True)
class DataParallelGroup:
    """The ranks a buffer's grads are reduced over (DP, or expert DP for experts), this rank's place in it, and
    the factor the grads are scaled by before summing (1 / DP for both)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    scale: float


def reduction_group(group: dist.ProcessGroup | None, scale_size: int | None = None) -> DataParallelGroup:
    """`group` (None: the default group) seen from this rank; grads scaled by 1 / `scale_size` (default its size)."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return DataParallelGroup(group, rank, size, 1.0 / (scale_size or size))


def is_expert_parameter(param: torch.nn.Parameter) -> bool:
    """An MoE expert's weight (Megatron marks them `allreduce = False`): split over expert parallelism, its grad
    reduced over expert data parallel."""
    return getattr(param, "allreduce", True) is False


class Bucket:
    """A slice of the grad buffer holding whole params; reduced with one collective over `dp` (its rank `dp.rank`
    owns the `dp.rank`-th equal part under the distributed optimizer).

    `offsets[i]` is where `params[i]` starts inside the bucket; `param_data` is the same slice of the param
    buffer (distributed optimizer only, else None).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        offsets: list[int],
        data: torch.Tensor,
        param_data: torch.Tensor | None,
        dp: DataParallelGroup,
    ) -> None:
        self.params = params
        self.offsets = offsets
        self.data = data
        self.param_data = param_data
        self.dp = dp
        self.pending: set[torch.nn.Parameter] = set(params)
        self.handle: dist.Work | None = None
        self.launched = False
        self.param_gather: dist.Work | None = None

    def reset(self) -> None:
        self.pending = set(self.params)
        self.handle = None
        self.launched = False

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's equal part of `tensor` (this bucket's grads or params)."""
        size = tensor.numel() // self.dp.size
        return tensor[self.dp.rank * size : (self.dp.rank + 1) * size]


class DistributedDataParallel(torch.nn.Module):
    """Wraps `module`; grads land in `param.main_grad` already averaged over `data_parallel_group` (experts' over
    `expert_data_parallel_group`, see the module docstring)."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: DDPConfig,
        data_parallel_group: dist.ProcessGroup | None = None,
        expert_data_parallel_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.dp = reduction_group(data_parallel_group)
        self.expert_dp = expert_dp = self.dp
        if any(is_expert_parameter(p) for p in module.parameters()):
            self.expert_dp = expert_dp = reduction_group(expert_data_parallel_group, scale_size=self.dp.size)
        bucket_size = config.bucket_size or max(DEFAULT_BUCKET_SIZE, 1_000_000 * self.dp.size)
        params = [p for p in module.parameters() if p.requires_grad]
        tied = getattr(module, "shared_embedding_or_output_weight", None)
        self.alone_in_bucket = tied() if config.use_distributed_optimizer and callable(tied) else None
        self.buffers: list[torch.Tensor] = []
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[torch.nn.Parameter, Bucket] = {}
        for expert, dp in ((False, self.dp), (True, expert_dp)):
            for dtype in dict.fromkeys(
                self._grad_dtype(p) for p in params if is_expert_parameter(p) == expert
            ):
                # Reverse order: roughly the order in which backward produces the grads.
                group = [
                    p
                    for p in reversed(params)
                    if self._grad_dtype(p) == dtype and is_expert_parameter(p) == expert
                ]
                self._build_buffer(dtype, group, bucket_size, dp)
        self.is_last_microbatch = True
        self._broadcast_params()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        if config.overlap_param_gather:
            for submodule in module.modules():
                if any(p.requires_grad for p in submodule.parameters(recurse=False)):
                    submodule.register_forward_pre_hook(self._wait_for_own_params)

    def _broadcast_params(self) -> None:
        """Start every DP replica from DP rank 0's weights (as Megatron's DDP does; experts from expert DP rank 0's)."""
        for param in self.module.parameters():
            dp = self.bucket_of[param].dp if param in self.bucket_of else self.dp
            if dp.size > 1:
                source = dist.get_global_rank(dp.group, 0) if dp.group is not None else 0
                dist.broadcast(param.data, src=source, group=dp.group)

    def _grad_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        return torch.float32 if self.config.grad_reduce_in_fp32 else param.dtype

    def _build_buffer(
        self, dtype: torch.dtype, params: list[torch.nn.Parameter], bucket_size: int, dp: DataParallelGroup
    ) -> None:
        """One grad buffer for `params` (and, sharded, one param buffer), split into buckets of whole params, each
        reduced over `dp`."""
        groups, current, current_numel = [], [], 0
        for param in params:
            if param is self.alone_in_bucket and current:
                groups.append(current)
                current, current_numel = [], 0
            current.append(param)
            current_numel += param.numel()
            if current_numel >= bucket_size or param is self.alone_in_bucket or param is params[-1]:
                groups.append(current)
                current, current_numel = [], 0
        multiple = dp.size if self.config.use_distributed_optimizer else 1
        sizes = [-(-sum(p.numel() for p in group) // multiple) * multiple for group in groups]
        buffer = torch.zeros(sum(sizes), dtype=dtype, device=params[0].device)
        self.buffers.append(buffer)
        param_buffer = (
            self._build_param_buffer(params, sum(sizes)) if self.config.use_distributed_optimizer else None
        )
        start = 0
        for group, size in zip(groups, sizes, strict=True):
            offsets, offset = [], start
            for param in group:
                param.main_grad = buffer[offset : offset + param.numel()].view_as(param)
                if param_buffer is not None:
                    param.data = (
                        param_buffer[offset : offset + param.numel()].view_as(param).copy_(param.data)
                    )
                offsets.append(offset - start)
                offset += param.numel()
            param_data = param_buffer[start : start + size] if param_buffer is not None else None
            bucket = Bucket(group, offsets, buffer[start : start + size], param_data, dp)
            self.buckets.append(bucket)
            self.bucket_of.update(dict.fromkeys(group, bucket))
            start += size

    def _build_param_buffer(self, params: list[torch.nn.Parameter], numel: int) -> torch.Tensor:
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"--use-distributed-optimizer needs one param dtype per grad buffer, got {sorted(map(str, dtypes))}"
            )
        return torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)

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
        dp = bucket.dp
        if dp.scale != 1.0:
            bucket.data.mul_(dp.scale)
        if dp.size == 1:
            return
        async_op = self.config.overlap_grad_reduce
        if self.config.use_distributed_optimizer:  # each rank keeps only its own part, reduced
            bucket.handle = _reduce_scatter(
                bucket.shard(bucket.data), bucket.data, group=dp.group, async_op=async_op
            )
        else:
            bucket.handle = dist.all_reduce(bucket.data, group=dp.group, async_op=async_op)

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

    def all_gather_params(self) -> None:
        """Distributed optimizer: after each rank updated its part of the param buffer, every rank gets all of it;
        with `overlap_param_gather` the gathers stay in flight until `finish_param_sync` or a forward needs them."""
        for bucket in reversed(self.buckets):  # the first layers' buckets first: the forward needs them first
            if bucket.dp.size > 1:
                bucket.param_gather = _all_gather(
                    bucket.param_data, bucket.shard(bucket.param_data), group=bucket.dp.group, async_op=True
                )
        if not self.config.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every param all-gather still in flight (before params are read outside a forward)."""
        for bucket in self.buckets:
            self._wait_for_param_gather(bucket)

    @staticmethod
    def _wait_for_param_gather(bucket: Bucket) -> None:
        if bucket.param_gather is not None:
            bucket.param_gather.wait()
            bucket.param_gather = None

    def _wait_for_own_params(self, submodule: torch.nn.Module, args: tuple) -> None:
        for param in submodule.parameters(recurse=False):
            if param in self.bucket_of:
                self._wait_for_param_gather(self.bucket_of[param])

    def zero_grad_buffer(self) -> None:
        for buffer in self.buffers:
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

    def finish_param_sync(self) -> None:
        """torch's DDP replicates params in full: nothing is in flight."""


def wrap_data_parallel(
    module: torch.nn.Module,
    ddp_impl: str,
    config: DDPConfig,
    data_parallel_group: dist.ProcessGroup | None,
    expert_data_parallel_group: dist.ProcessGroup | None = None,
) -> torch.nn.Module:
    """Wrap `module` with the chosen implementation (`local`: ours, `torch`: torch's DDP, which averages every grad
    over DP: arguments.validate_config refuses it with expert parallelism)."""
    if ddp_impl == "local":
        return DistributedDataParallel(module, config, data_parallel_group, expert_data_parallel_group)
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
