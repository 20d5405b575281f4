"""What a pipeline stage's tensors are called in a checkpoint, and the sharding record each one carries.

A checkpoint names every tensor by its global name (`decoder.layers.<global layer>.`) whatever (TP, PP,
virtual) layout saved it, and records its global shape, TP split and PP stage beside it, so any layout can
find and cut its part (docs/architecture.md, checkpoints). The pure cutting rules live in `layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing.files import CheckpointError
from megatron_train.checkpointing.layout import (
    OUTPUT_WEIGHT,
    WORD_EMBEDDING,
    ExpertLayout,
    TensorSharding,
    global_param_name,
    layer_number,
    param_sharding,
)
from megatron_train.distributed.ddp import is_expert_parameter
from megatron_train.families.registry import DEFAULT_FAMILY, get_family
from megatron_train.parallel import state

StageModel = torch.nn.Module | Sequence[torch.nn.Module]  # one pipeline stage, or its virtual-stage chunks


def chunks(model: StageModel) -> list[torch.nn.Module]:
    return [model] if isinstance(model, torch.nn.Module) else list(model)


def stage_module(model: StageModel) -> torch.nn.Module:
    """The stage as one module: itself, or its chunks in a ModuleList, whose names `<chunk>.<name>` are the
    ones the optimizer gives the params of several chunks."""
    parts = chunks(model)
    return parts[0] if len(parts) == 1 else torch.nn.ModuleList(parts)


def model_type(model: StageModel) -> str:
    """The model family of a stage (the model class's `model_type`, its `ModelFamily.name`), which checkpoints
    record so that a GPT checkpoint never loads into a BERT model or back."""
    return getattr(chunks(model)[0], "model_type", DEFAULT_FAMILY)


def global_names(model: StageModel, config: MegatronConfig) -> dict[str, str]:
    """This pipeline stage's state-dict names (`<chunk>.<name>` for several chunks) -> checkpoint names: global
    layer numbers from each chunk's layer range (its family's `pipeline`), a tied output layer off the first
    stage -> the word embedding."""
    parts = chunks(model)
    virtual_size = state.get_virtual_pipeline_model_parallel_world_size()
    if len(parts) != (virtual_size or 1):
        raise CheckpointError(
            f"got {len(parts)} model chunks but this run has {virtual_size or 1} virtual pipeline stages per "
            "rank (--num-layers-per-virtual-pipeline-stage): pass one chunk per virtual stage, in order"
        )
    pp_rank = state.get_pipeline_model_parallel_rank()
    pp_size = state.get_pipeline_model_parallel_world_size()
    split = get_family(config.model.model_family or model_type(model)).pipeline
    tied = not config.model.untie_embeddings_and_output_weights
    names = {}
    for virtual_rank, chunk in enumerate(parts):
        layers = split.layer_range(config.model, pp_rank, pp_size, virtual_rank, virtual_size)
        tied_copy = tied and (pp_rank, virtual_rank) != (0, 0)
        prefix = f"{virtual_rank}." if len(parts) > 1 else ""
        for name in chunk.state_dict():
            names[prefix + name] = global_param_name(name, layers.start, tied_copy)
    return names


def owned(names: dict[str, str]) -> dict[str, str]:
    """Drop the tied output copy: the stage holding the word embedding saves it."""
    return {
        local: name
        for local, name in names.items()
        if not (name == WORD_EMBEDDING and local.endswith(OUTPUT_WEIGHT))
    }


def current_expert_layout() -> ExpertLayout:
    """This rank's place among the MoE experts' ranks (one rank holding all of them without process groups)."""
    return ExpertLayout(
        state.get_expert_model_parallel_world_size(),
        state.get_expert_model_parallel_rank(),
        state.get_expert_tensor_parallel_world_size(),
        state.get_expert_tensor_parallel_rank(),
    )


def expert_names(model: torch.nn.Module, names: dict[str, str]) -> dict[str, str]:
    """The entries of `names` (state-dict name -> checkpoint name) that are MoE expert weights."""
    params = dict(model.named_parameters())
    return {
        local: name for local, name in names.items() if local in params and is_expert_parameter(params[local])
    }


def sharding_record(
    global_shape: list[int],
    sharding: TensorSharding,
    sequence_parallel: bool,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    name: str,
    experts: ExpertLayout | None = None,
) -> dict[str, Any]:
    """What a shard file records of one tensor: global shape, TP split, and PP stage and global layer; an MoE
    expert weight also its EP rank and size (its TP fields then count expert TP ranks)."""
    if experts is not None:
        return {
            **sharding_record(global_shape, sharding, sequence_parallel, experts.etp_rank, experts.etp_size,
                              pp_rank, pp_size, name),
            "ep_rank": experts.ep_rank,
            "ep_size": experts.ep_size,
        }  # fmt: skip
    return {
        "global_shape": global_shape,
        "tensor_model_parallel": sharding.is_split,
        "partition_dim": sharding.partition_dim,
        "partition_stride": sharding.partition_stride,
        "partition_sizes": None if sharding.partition_sizes is None else list(sharding.partition_sizes),
        "sequence_parallel": sequence_parallel,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "pp_rank": pp_rank,
        "pp_size": pp_size,
        "layer": layer_number(name),
    }


def sharding_records(model: torch.nn.Module, names: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per saved tensor of this rank: its record (Megatron's param attributes tell the TP split; an MoE expert
    weight is split over expert TP and, along its first axis, over EP)."""
    params = dict(model.named_parameters())
    weights = model.state_dict()
    experts = expert_names(model, names)
    records = {}
    for local, name in names.items():
        param = params.get(local)
        layout = current_expert_layout() if local in experts else None
        tp_size = layout.etp_size if layout else state.get_tensor_model_parallel_world_size()
        sharding = param_sharding(param)
        global_shape = list(weights[local].shape)
        if sharding.is_split:
            global_shape[sharding.partition_dim] *= tp_size
        if layout:
            global_shape[0] *= layout.ep_size
        records[name] = sharding_record(
            global_shape,
            sharding,
            bool(getattr(param, "sequence_parallel", False)),
            state.get_tensor_model_parallel_rank(),
            tp_size,
            state.get_pipeline_model_parallel_rank(),
            state.get_pipeline_model_parallel_world_size(),
            name,
            layout,
        )
    return records


def rename_optimizer_state(
    tensors: dict[str, torch.Tensor], meta: dict, names: dict[str, str]
) -> tuple[dict[str, torch.Tensor], dict]:
    """The optimizer's per-param state under checkpoint names; params missing from `names` are dropped."""
    renamed = {}
    for key, tensor in tensors.items():
        param, state_name = key.rsplit(".", 1)
        if param in names:
            renamed[f"{names[param]}.{state_name}"] = tensor
    return renamed, {
        **meta,
        "param_names": [names[n] for n in meta["param_names"] if n in names],
        "scalars": {names[n]: v for n, v in meta["scalars"].items() if n in names},
        "tensor_states": {names[n]: v for n, v in meta["tensor_states"].items() if n in names},
    }


def param_of(name: str, kind: str) -> str:
    """The param an optimizer tensor `<param>.<state>` belongs to (a model tensor is its own)."""
    return name if kind == "model" else name.rsplit(".", 1)[0]
