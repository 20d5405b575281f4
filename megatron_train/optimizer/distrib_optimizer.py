"""Megatron's distributed optimizer (`--use-distributed-optimizer`): fp32 main params and Adam states sharded
over the data-parallel group, as Megatron-Core's DistributedOptimizer.

Layout: our DDP (built with `DDPConfig(use_distributed_optimizer=True)`) pads every grad bucket to a multiple
of the DP size, and DP rank r owns the r-th equal part of each bucket. A param may straddle two ranks' parts;
each rank keeps the fp32 main copy and the optimizer state of only the elements inside its part (a
`ParamShard`). One step: grads are reduce-scattered into the owners' parts (by the DDP, during backward with
--overlap-grad-reduce); the found-inf flag and the grad norm are reduced over DP as well as model parallel;
each rank steps its shards, copies them into the model's param buffer (rounding to bf16/fp16), and the
buffer is all-gathered so every rank has the whole updated model.

Pipeline parallelism: each rank optimizes its own stage; under virtual stages it holds several model chunks,
each in its own DDP, and one DistributedOptimizer spans all their buffers (the simplest equivalent of
Megatron-Core's ChainedOptimizer over one optimizer per chunk): one torch optimizer, one found-inf flag and one
grad norm per step, reduced over DP and then over the model-parallel group (TP x PP), so every stage's shards
count exactly once. Params are named `<chunk>.<name>` then, as the plain optimizer over the chunk list.

Checkpoints keep the layout-independent format of `MegatronOptimizer.state_dict()`: `state_dict()` gathers the
shards to DP rank 0 (a collective: call it on every DP rank), `load_state_dict()` takes each rank's part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_train.distributed.ddp import Bucket, DistributedDataParallel
from megatron_train.optimizer.optimizer import MegatronOptimizer
from megatron_train.training.config import OptimizerConfig


@dataclass(frozen=True)
class ParamShard:
    """Elements [start, end) of a flattened param owned by this DP rank; the param begins at `offset` of
    `bucket` (Megatron's param_range inside the gbuf_range_map)."""

    bucket: Bucket
    offset: int
    start: int
    end: int


def shards_of_bucket(bucket: Bucket) -> dict[torch.nn.Parameter, ParamShard]:
    """The part of each param of `bucket` that falls into this rank's equal part of the bucket."""
    part = bucket.data.numel() // bucket.dp.size
    low, high = bucket.dp.rank * part, (bucket.dp.rank + 1) * part
    shards = {}
    for param, offset in zip(bucket.params, bucket.offsets, strict=True):
        start, end = max(low, offset) - offset, min(high, offset + param.numel()) - offset
        if start < end:
            shards[param] = ParamShard(bucket, offset, start, end)
    return shards


def chunk_named_parameters(chunks: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """Params of the model chunks named as in their state dicts: `<name>` for one chunk, `<chunk>.<name>` for
    several (virtual pipeline stages), as torch names the params of a ModuleList of the chunks."""
    if len(chunks) == 1:
        return list(chunks[0].named_parameters())
    return list(torch.nn.ModuleList(chunks).named_parameters())


class DistributedOptimizer(MegatronOptimizer):
    """MegatronOptimizer whose main params are this DP rank's shards of the model chunks' param buffers.

    `model` is one local DDP or a list of them (one per virtual pipeline stage), all over the same DP group.
    """

    shards_state_over_data_parallel = True

    def __init__(
        self,
        model: DistributedDataParallel | list[DistributedDataParallel],
        config: OptimizerConfig,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.ddps = list(model) if isinstance(model, list | tuple) else [model]
        for chunk in self.ddps:
            if not isinstance(chunk, DistributedDataParallel) or not chunk.config.use_distributed_optimizer:
                raise ValueError(
                    "--use-distributed-optimizer shards the local DDP's buffers: wrap each model chunk with "
                    "DistributedDataParallel(module, DDPConfig(use_distributed_optimizer=True)) (--ddp-impl local)"
                )
        first = self.ddps[0]
        if any(chunk.dp.group is not first.dp.group for chunk in self.ddps):
            raise ValueError(
                "--use-distributed-optimizer: every model chunk's DDP must use the same DP group"
            )
        self.dp = first.dp
        self.grads_sharded_over = (first.dp, first.expert_dp)
        self.buckets = [bucket for chunk in self.ddps for bucket in chunk.buckets]
        self.shards: dict[torch.nn.Parameter, ParamShard] = {}
        for bucket in self.buckets:
            self.shards.update(shards_of_bucket(bucket))
        named_params = chunk_named_parameters([chunk.module for chunk in self.ddps])
        super().__init__(named_params, config, params_dtype)

    def _model_shard(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's elements of `param`, a view into the DDP's param buffer."""
        shard = self.shards[param]
        return param.detach().view(-1)[shard.start : shard.end]

    def _build_main_params(self) -> list[torch.Tensor | None]:
        """fp32 copies of this rank's shards (views of the param buffer itself for fp32 models); None where
        this rank owns no element of a param."""
        mains: list[torch.Tensor | None] = []
        for param in self.model_params:
            if param not in self.shards:
                mains.append(None)
            elif self.mixed_precision:
                mains.append(self._model_shard(param).float().clone())
            else:
                mains.append(self._model_shard(param))
        return mains

    def _main_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each main shard's grad is its part of the reduce-scattered grad buffer (an fp32 copy for fp16)."""
        params, grads = [], []
        for model, main in zip(self.model_params, self.main_params, strict=True):
            if main is None:
                continue
            shard = self.shards[model]
            main.grad = model.main_grad.view(-1)[shard.start : shard.end].float()
            params.append(main)
            grads.append(main.grad)
        return params, grads

    def _copy_main_params_to_model_params(self) -> None:
        """Write the updated shards into the param buffers, then all-gather each chunk's buffer over DP."""
        if self.mixed_precision:
            for model, main in zip(self.model_params, self.main_params, strict=True):
                if main is not None:
                    self._model_shard(model).copy_(main)
        for chunk in self.ddps:
            chunk.all_gather_params()

    def reload_model_params(self) -> None:
        if self.mixed_precision:
            for model, main in zip(self.model_params, self.main_params, strict=True):
                if main is not None:
                    main.copy_(self._model_shard(model))

    def local_param_ranges(self) -> list[tuple[int, int, int]]:
        """This DP rank's part of each param: the elements of its bucket part (its `ParamShard`)."""
        return [
            (i, self.shards[p].start, self.shards[p].end)
            for i, p in enumerate(self.model_params)
            if self.main_params[i] is not None
        ]

    def _local_part(self, index: int, full: torch.Tensor) -> torch.Tensor:
        shard = self.shards[self.model_params[index]]
        return full.reshape(-1)[shard.start : shard.end]

    @torch.no_grad()
    def _full_param_states(self) -> list[tuple[str, torch.Tensor, dict]]:
        """Gather every DP rank's shards into full tensors on DP rank 0, in CPU memory as Megatron's
        get_parameter_state_dp_zero (collective over DP; the experts' over expert DP, to expert DP rank 0). A rank
        gets the params whose first data-parallel rank it is (none on most). Per bucket and state, each rank
        contributes its part of the bucket."""
        main_of = dict(zip(self.model_params, self.main_params, strict=True))
        first_state = next(iter(self.optimizer.state.values()), {})
        tensor_keys = self._broadcast_from_first_dp_rank(
            [k for k, v in first_state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        )
        keys = ["main_param", *tensor_keys] if self.mixed_precision else tensor_keys
        full: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        for bucket in self.buckets:
            part = bucket.data.numel() // bucket.dp.size
            low = bucket.dp.rank * part
            for key in keys:
                local = torch.zeros(part, dtype=torch.float32, device=bucket.data.device)
                for param in bucket.params:
                    if param not in self.shards:
                        continue
                    shard, main = self.shards[param], main_of[param]
                    value = main if key == "main_param" else self.optimizer.state[main][key]
                    begin = shard.offset + shard.start - low
                    local[begin : begin + shard.end - shard.start] = value.view(-1)
                flat = _gather_to_first_rank(local, bucket)
                if flat is not None:
                    for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                        full.setdefault(param, {})[key] = (
                            flat[offset : offset + param.numel()].view_as(param).to("cpu", copy=True)
                        )
            if bucket.dp.rank == 0 and not keys:  # an optimizer without tensor state (SGD without momentum)
                full.update({param: {} for param in bucket.params})
        scalars = {k: v for k, v in first_state.items() if k not in tensor_keys}
        return [
            (name, full[param].pop("main_param", param.detach()), {**scalars, **full[param]})
            for name, param in zip(self.names, self.model_params, strict=True)
            if param in full
        ]

    def _broadcast_from_first_dp_rank(self, keys: list[str]) -> list[str]:
        """DP rank 0's state names (it owns the start of every bucket; a rank may own only padding)."""
        if self.dp.size == 1:
            return keys
        message = [keys]
        source = dist.get_global_rank(self.dp.group, 0) if self.dp.group is not None else 0
        dist.broadcast_object_list(message, src=source, group=self.dp.group)
        return message[0]


def _gather_to_first_rank(local: torch.Tensor, bucket: Bucket) -> torch.Tensor | None:
    """Every rank's `local` part of `bucket` concatenated in rank order on the bucket's first data-parallel rank;
    None on the others."""
    dp = bucket.dp
    if dp.size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dp.size)] if dp.rank == 0 else None
    dist.gather(
        local, parts, dst=dist.get_global_rank(dp.group, 0) if dp.group is not None else 0, group=dp.group
    )
    return torch.cat(parts) if parts is not None else None
