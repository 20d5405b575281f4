"""Process groups for tensor, context, data, pipeline and expert parallelism, in Megatron's rank order.

Ranks are laid out as Megatron-Core's `RankGenerator` lays them out for its default order "tp-cp-ep-dp-pp":
tensor parallel fastest, then context, then data, then pipeline parallel. Without context parallelism,
global rank = pp_rank * (DP * TP) + dp_rank * TP + tp_rank. Example (Megatron's), 16 ranks, TP=2, PP=4:
TP groups [0, 1], [2, 3], ...; DP groups [0, 2], [1, 3], [4, 6], ...; PP groups [0, 4, 8, 12], [1, 5, 9, 13], ...
With CP=2, TP=2 on 8 ranks: CP groups [0, 2], [1, 3], [4, 6], [5, 7]; DP groups [0, 4], [1, 5], ...; the ranks of
one CP group hold the same weights and different parts of each sequence, so gradients are reduced (and the
distributed optimizer shards) over data x context parallel (`data_with_context`: [0, 2, 4, 6], [1, 3, 5, 7]),
while the data loader splits samples over data parallel alone.

Expert layers (MoE) see the same ranks through a second generator with the same order and no context dimension:
expert tensor parallel (ETP, default TP) fastest, then expert model parallel (EP), then expert data parallel
(EDP = world / (ETP x EP x PP)), then the same pipeline stages. The expert ranks are taken from the dense layers'
data (and tensor, context) dimensions: with TP=1, EP=2 on 4 ranks the EP groups are [0, 1], [2, 3] and each
expert's gradient is reduced over its EDP group [0, 2] or [1, 3] (docs/architecture.md, mixture of experts).

Before `initialize_model_parallel` (or with torch.distributed uninitialised) every size is 1 and
every rank 0, so single-process code runs unchanged; asking for a group then raises.

The layers do not read these globals: the model provider gives a model its `ProcessGroupCollection`
(`process_groups()`, Megatron-Core's pg_collection), which it passes down to the parallel layers, the attention
and the cross entropy; a layer given no group takes this state's (`tensor_group_or_default`) as the default.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist

ORDER = "tp-cp-ep-dp-pp"  # Megatron-Core's default --order


def masked_rank_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """The groups of ranks that differ only along the dimensions `mask` selects (Megatron-Core's
    `generate_masked_orthogonal_rank_groups`): `sizes` lists each dimension's size, fastest first, so that
    global rank = sum(index_d * prod(sizes before d)). Groups are ordered by the indices of the other
    dimensions (fastest first), ranks within a group by the selected indices (fastest first)."""
    strides = [math.prod(sizes[:d]) for d in range(len(sizes))]
    selected = [d for d, on in enumerate(mask) if on]
    others = [d for d, on in enumerate(mask) if not on]

    def positions(dims: list[int]) -> list[int]:
        """Offsets of every index combination of `dims` (the first dimension fastest)."""
        offsets = [0]
        for d in dims:
            offsets = [offset + i * strides[d] for i in range(sizes[d]) for offset in offsets]
        return offsets

    return [[base + inner for inner in positions(selected)] for base in positions(others)]


@dataclass(frozen=True)
class RankGenerator:
    """Megatron-Core's RankGenerator: the rank groups of any combination of parallel dimensions (`tp`, `cp`, `ep`,
    `dp`, `pp`) of one layout, in `ORDER`."""

    tp: int
    cp: int
    ep: int
    dp: int
    pp: int

    def ranks(self, token: str) -> list[list[int]]:
        """The groups of the dimensions in `token` ("tp", "tp-ep", "tp-cp-dp", ...)."""
        names = ORDER.split("-")
        sizes = [getattr(self, name) for name in names]
        return masked_rank_groups(sizes, [name in token.split("-") for name in names])


@dataclass(frozen=True)
class RankGroups:
    """The global ranks of every group of each kind (each list of lists partitions the world)."""

    tensor: list[list[int]]
    data: list[list[int]]
    pipeline: list[list[int]]
    model: list[list[int]]  # TP x PP: all ranks holding one full model replica (its dense layers)
    embedding: list[list[int]]  # first and last pipeline stage: they share the tied word embedding
    context: list[list[int]]  # CP: the ranks splitting one sequence
    data_with_context: list[list[int]]  # DP x CP: the ranks whose gradients are reduced together
    tensor_and_context: list[list[int]]  # TP x CP: the tokens of one micro-batch (MoE aux-loss statistics)
    tensor_and_data: list[list[int]]  # TP x CP x DP: every token of a step (global aux loss, expert bias)
    expert_tensor: list[list[int]]  # ETP: one expert's weight split
    expert_model: list[list[int]]  # EP: the ranks holding the different experts, tokens exchanged among them
    expert_data: list[list[int]]  # EDP: the replicas of the same experts, their gradients reduced together
    expert_tensor_and_model: list[list[int]]  # ETP x EP: the all-gather token dispatcher's group
    expert_tensor_model_pipeline: list[list[int]]  # ETP x EP x PP: every expert weight once (grad norm)


def build_rank_groups(
    world_size: int,
    tensor_size: int,
    pipeline_size: int,
    context_size: int = 1,
    expert_size: int = 1,
    expert_tensor_size: int | None = None,
) -> RankGroups:
    """Partition `world_size` ranks into groups; raises when the sizes do not divide the world."""
    expert_tensor_size = tensor_size if expert_tensor_size is None else expert_tensor_size
    dense = tensor_size * context_size * pipeline_size
    if min(tensor_size, pipeline_size, context_size) < 1 or world_size % dense:
        context = f" x --context-parallel-size {context_size}" if context_size != 1 else ""
        raise ValueError(
            f"world size {world_size} is not divisible by tensor-model-parallel-size {tensor_size}{context} x "
            f"pipeline-model-parallel-size {pipeline_size}; launch a multiple of {dense} processes or change the "
            "parallel sizes"
        )
    experts = expert_tensor_size * expert_size * pipeline_size
    if min(expert_size, expert_tensor_size) < 1 or world_size % experts:
        raise ValueError(
            f"world size {world_size} is not divisible by --expert-tensor-parallel-size {expert_tensor_size} x "
            f"--expert-model-parallel-size {expert_size} x --pipeline-model-parallel-size {pipeline_size}; launch "
            f"a multiple of {experts} processes or change the expert parallel sizes"
        )
    layers = RankGenerator(tensor_size, context_size, 1, world_size // dense, pipeline_size)
    expert = RankGenerator(expert_tensor_size, 1, expert_size, world_size // experts, pipeline_size)
    pipeline = layers.ranks("pp")
    return RankGroups(
        tensor=layers.ranks("tp"),
        data=layers.ranks("dp"),
        pipeline=pipeline,
        model=layers.ranks("tp-pp"),
        embedding=[sorted({ranks[0], ranks[-1]}) for ranks in pipeline],
        context=layers.ranks("cp"),
        data_with_context=layers.ranks("cp-dp"),
        tensor_and_context=layers.ranks("tp-cp"),
        tensor_and_data=layers.ranks("tp-cp-dp"),
        expert_tensor=expert.ranks("tp"),
        expert_model=expert.ranks("ep"),
        expert_data=expert.ranks("dp"),
        expert_tensor_and_model=expert.ranks("tp-ep"),
        expert_tensor_model_pipeline=expert.ranks("tp-ep-pp"),
    )


GROUP_KINDS = tuple(RankGroups.__dataclass_fields__)


@dataclass
class _ParallelState:
    groups: dict[str, dist.ProcessGroup]
    ranks: dict[str, list[int]]  # this process's group of each kind, as global ranks
    virtual_pipeline_size: int | None
    checkpoint: dist.ProcessGroup | None = None  # every rank over gloo, made at the first checkpoint


_STATE: _ParallelState | None = None


@dataclass(frozen=True)
class ProcessGroupCollection:
    """The process groups a model communicates over (Megatron-Core's ProcessGroupCollection): tensor parallel
    (`tp`), pipeline (`pp`), data parallel (`dp`), model parallel (`mp`: TP x PP), the tied embedding's first
    and last stage (`embd`), context parallel (`cp`) and data x context parallel (`dp_cp`: gradients); for MoE
    layers the expert-parallel (`ep`), expert tensor-parallel (`expt_tp`) and expert data-parallel (`expt_dp`,
    which holds the CP ranks too) groups, ETP x EP (`tp_ep`, the all-gather dispatcher's) and ETP x EP x PP
    (`tp_ep_pp`), and the ranks sharing a micro-batch's tokens (`tp_cp`) or a step's (`tp_dp_cp`). None: no group,
    this process alone (a model built without process groups). A new parallel dimension adds its groups here, made
    by `initialize_model_parallel` and handed to the layers that use them the same way."""

    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    mp: dist.ProcessGroup | None = None
    embd: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    dp_cp: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    expt_tp: dist.ProcessGroup | None = None
    expt_dp: dist.ProcessGroup | None = None
    tp_ep: dist.ProcessGroup | None = None
    tp_ep_pp: dist.ProcessGroup | None = None
    tp_cp: dist.ProcessGroup | None = None
    tp_dp_cp: dist.ProcessGroup | None = None


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
        cp=groups["context"],
        dp_cp=groups["data_with_context"],
        ep=groups["expert_model"],
        expt_tp=groups["expert_tensor"],
        expt_dp=groups["expert_data"],
        tp_ep=groups["expert_tensor_and_model"],
        tp_ep_pp=groups["expert_tensor_model_pipeline"],
        tp_cp=groups["tensor_and_context"],
        tp_dp_cp=groups["tensor_and_data"],
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
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
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
        dist.get_world_size(),
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        expert_tensor_parallel_size,
    )
    me = dist.get_rank()
    groups: dict[str, dist.ProcessGroup] = {}
    ranks: dict[str, list[int]] = {}
    for kind in GROUP_KINDS:
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


def get_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """The data-parallel replicas (samples are split over them); `with_context_parallel`: also the context-parallel
    ranks of each, the group gradients are reduced and the distributed optimizer shards over (Megatron's)."""
    return _group("data_with_context" if with_context_parallel else "data")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _world_size("data_with_context" if with_context_parallel else "data")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank("data_with_context" if with_context_parallel else "data")


def get_context_parallel_group() -> dist.ProcessGroup:
    """The ranks that split each sequence between them (ring attention passes keys and values around it)."""
    return _group("context")


def get_context_parallel_world_size() -> int:
    return _world_size("context")


def get_context_parallel_rank() -> int:
    return _rank("context")


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


def get_checkpoint_group() -> dist.ProcessGroup:
    """Every rank, over gloo (Megatron's gloo groups for checkpoints): a distributed checkpoint's planning and
    completion run on it, also from the thread of an asynchronous save while training uses the other groups.
    Made by the first checkpoint save or load, which every rank calls at the same point."""
    if _STATE is None:
        raise RuntimeError("the checkpoint group does not exist yet: call initialize_model_parallel first")
    if _STATE.checkpoint is None:
        _STATE.checkpoint = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    return _STATE.checkpoint


def get_embedding_group() -> dist.ProcessGroup:
    """First and last pipeline stage: they all-reduce the tied word embedding's gradient."""
    return _group("embedding")


def get_expert_model_parallel_world_size() -> int:
    return _world_size("expert_model")


def get_expert_model_parallel_rank() -> int:
    return _rank("expert_model")


def get_expert_tensor_parallel_world_size() -> int:
    return _world_size("expert_tensor")


def get_expert_tensor_parallel_rank() -> int:
    return _rank("expert_tensor")


def get_expert_data_parallel_world_size() -> int:
    return _world_size("expert_data")


def get_expert_data_parallel_rank() -> int:
    return _rank("expert_data")


def get_expert_data_parallel_group() -> dist.ProcessGroup:
    """The replicas of this rank's experts: expert gradients are reduced over it."""
    return _group("expert_data")


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
