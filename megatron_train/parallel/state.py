"""Process groups for tensor, data and pipeline parallelism, in Megatron's rank order.

Ranks are laid out with tensor parallel fastest, then data parallel, then pipeline parallel:
global rank = pp_rank * (DP * TP) + dp_rank * TP + tp_rank. Example (Megatron's), 16 ranks, TP=2, PP=4:
TP groups [0, 1], [2, 3], ...; DP groups [0, 2], [1, 3], [4, 6], ...; PP groups [0, 4, 8, 12], [1, 5, 9, 13], ...

Before `initialize_model_parallel` (or with torch.distributed uninitialised) every size is 1 and
every rank 0, so single-process code runs unchanged; asking for a group then raises.

The layers do not read these globals: the model provider gives a model its `ProcessGroupCollection`
(`process_groups()`, Megatron-Core's pg_collection), which it passes down to the parallel layers, the attention
and the cross entropy; a layer given no group takes this state's (`tensor_group_or_default`) as the default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class RankGroups:
    """The global ranks of every group of each kind (each list of lists partitions the world)."""

    tensor: list[list[int]]
    data: list[list[int]]
    pipeline: list[list[int]]
    model: list[list[int]]  # TP x PP: all ranks holding one full model replica
    embedding: list[list[int]]  # first and last pipeline stage: they share the tied word embedding


def build_rank_groups(world_size: int, tensor_size: int, pipeline_size: int) -> RankGroups:
    """Partition `world_size` ranks into groups; raises when the sizes do not divide the world."""
    if tensor_size < 1 or pipeline_size < 1 or world_size % (tensor_size * pipeline_size):
        raise ValueError(
            f"world size {world_size} is not divisible by tensor-model-parallel-size {tensor_size} x "
            f"pipeline-model-parallel-size {pipeline_size}; launch a multiple of {tensor_size * pipeline_size} "
            "processes or change the parallel sizes"
        )
    data_size = world_size // (tensor_size * pipeline_size)

    def rank(pp: int, dp: int, tp: int) -> int:
        return pp * data_size * tensor_size + dp * tensor_size + tp

    pp_range, dp_range, tp_range = range(pipeline_size), range(data_size), range(tensor_size)
    pipeline = [[rank(pp, dp, tp) for pp in pp_range] for dp in dp_range for tp in tp_range]
    return RankGroups(
        tensor=[[rank(pp, dp, tp) for tp in tp_range] for pp in pp_range for dp in dp_range],
        data=[[rank(pp, dp, tp) for dp in dp_range] for pp in pp_range for tp in tp_range],
        pipeline=pipeline,
        model=[[rank(pp, dp, tp) for pp in pp_range for tp in tp_range] for dp in dp_range],
        embedding=[sorted({ranks[0], ranks[-1]}) for ranks in pipeline],
    )


@dataclass
class _ParallelState:
    groups: dict[str, dist.ProcessGroup]
    ranks: dict[str, list[int]]  # this process's group of each kind, as global ranks
    virtual_pipeline_size: int | None


_STATE: _ParallelState | None = None


@dataclass(frozen=True)
class ProcessGroupCollection:
    """The process groups a model communicates over (Megatron-Core's ProcessGroupCollection): tensor parallel
    (`tp`), pipeline (`pp`), data parallel (`dp`), model parallel (`mp`: TP x PP) and the tied embedding's first
    and last stage (`embd`). None: no group, this process alone (a model built without process groups). A new
    parallel dimension adds its groups here (context parallel, expert parallel and its data-parallel group), made
    by `initialize_model_parallel` and handed to the layers that use them the same way."""

    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    mp: dist.ProcessGroup | None = None
    embd: dist.ProcessGroup | None = None


def process_groups() -> ProcessGroupCollection:
    """This rank's groups (Megatron-Core's `ProcessGroupCollection.use_mpu_process_groups`); all None before
    `initialize_model_parallel`."""
    if _STATE is None:
        return ProcessGroupCollection()
    groups = _STATE.groups
    return ProcessGroupCollection(
        tp=groups["tensor"],
        pp=groups["pipeline"],
        dp=groups["data"],
        mp=groups["model"],
        embd=groups.get("embedding"),  # only the first and last pipeline stages are in one
    )


def tensor_group_or_default(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """`group`, else this state's tensor-parallel group (None before `initialize_model_parallel`: alone)."""
    if group is not None or _STATE is None:
        return group
    return _STATE.groups["tensor"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group`; 1 for None (this process alone)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in `group`; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
) -> None:
    """Create every process group; all ranks must call this together after `dist.init_process_group`."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs torch.distributed: call dist.init_process_group first "
            "(torchrun sets the environment; see megatron_train.device.get_backend)"
        )
    if _STATE is not None:
        raise RuntimeError("model parallel groups are already initialised; call destroy_model_parallel first")
    layout = build_rank_groups(
        dist.get_world_size(), tensor_model_parallel_size, pipeline_model_parallel_size
    )
    me = dist.get_rank()
    groups: dict[str, dist.ProcessGroup] = {}
    ranks: dict[str, list[int]] = {}
    for kind in ("tensor", "data", "pipeline", "model", "embedding"):
        for group_ranks in getattr(layout, kind):
            group = dist.new_group(group_ranks)  # every rank creates every group, in the same order
            if me in group_ranks:
                groups[kind], ranks[kind] = group, group_ranks
    _STATE = _ParallelState(groups, ranks, virtual_pipeline_model_parallel_size)


def destroy_model_parallel() -> None:
    """Forget the groups (the default process group stays)."""
    global _STATE
    _STATE = None


@contextlib.contextmanager
def single_process_view() -> Iterator[None]:
    """Every size 1 and every rank 0 inside, as before `initialize_model_parallel`: for building the whole model
    (the converter's meta-device model) on a process that is one rank of a layout."""
    global _STATE
    saved, _STATE = _STATE, None
    try:
        yield
    finally:
        _STATE = saved


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def _group(kind: str) -> dist.ProcessGroup:
    if _STATE is None:
        raise RuntimeError(
            f"the {kind} parallel group does not exist yet: call initialize_model_parallel first"
        )
    return _STATE.groups[kind]


def _world_size(kind: str) -> int:
    return 1 if _STATE is None else len(_STATE.ranks[kind])


def _rank(kind: str) -> int:
    return 0 if _STATE is None else _STATE.ranks[kind].index(dist.get_rank())


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return _group("tensor")


def get_tensor_model_parallel_world_size() -> int:
    return _world_size("tensor")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tensor")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this process's TP group (for broadcasts within the group)."""
    return 0 if _STATE is None else _STATE.ranks["tensor"][0]


def get_data_parallel_group() -> dist.ProcessGroup:
    return _group("data")


def get_data_parallel_world_size() -> int:
    return _world_size("data")


def get_data_parallel_rank() -> int:
    return _rank("data")


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    return _group("pipeline")


def get_pipeline_model_parallel_world_size() -> int:
    return _world_size("pipeline")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pipeline")


def get_pipeline_model_parallel_ranks() -> list[int]:
    """Global ranks of this process's pipeline, stage 0 first (for point-to-point sends)."""
    return [0] if _STATE is None else list(_STATE.ranks["pipeline"])


def get_model_parallel_group() -> dist.ProcessGroup:
    """TP x PP ranks of one model replica (grad-norm and inf checks reduce over it)."""
    return _group("model")


def get_embedding_group() -> dist.ProcessGroup:
    """First and last pipeline stage: they all-reduce the tied word embedding's gradient."""
    return _group("embedding")


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return None if _STATE is None else _STATE.virtual_pipeline_size


def is_pipeline_first_stage(vp_stage: int | None = None) -> bool:
    """This rank is the first pipeline stage; given `vp_stage` (a model chunk's virtual pipeline rank, as
    Megatron-Core passes it), that chunk is also the first of its rank, i.e. virtual stage 0."""
    if vp_stage is not None and vp_stage != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(vp_stage: int | None = None) -> bool:
    """This rank is the last pipeline stage; given `vp_stage`, that chunk is also the last of its rank."""
    virtual_size = get_virtual_pipeline_model_parallel_world_size()
    if vp_stage is not None and virtual_size is not None and vp_stage != virtual_size - 1:
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1
