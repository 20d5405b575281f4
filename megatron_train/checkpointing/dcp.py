"""Megatron-Core's `torch_dist` checkpoints at the level of PyTorch's distributed checkpoint (DCP): chunks of global
tensors written by the ranks that hold them, read back by any other cut, and the safe reading of DCP's index.

`ChunkSavePlanner` writes a rank's chunks (each a block of a global tensor at its offsets) and serialised objects;
`ChunkLoadPlanner` reads any blocks of the saved global tensors into destination tensors (views of a rank's
parameters and optimizer state), so a checkpoint written under one layout is read under another without any
rank assembling whole tensors. The converter (`convert.torch_dist`) and training's own torch_dist saves
(`checkpointing.dist_checkpoint`) share these. DCP's `.metadata` is a pickle: `SafeReader` reads it with an
unpickler that resolves only DCP's metadata classes (docs/architecture.md, checkpoints).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_train.checkpointing.files import CheckpointError
from megatron_train.checkpointing.layout import TensorSharding
from megatron_train.parallel.layers import rank_pieces

if TYPE_CHECKING:  # arguments imports the families, which import the checkpointing package
    from megatron_train.arguments import MegatronConfig
    from megatron_train.models.config import TransformerConfig

CHECKPOINT_VERSION = 3.0  # Megatron-LM's checkpoint_version of the files it reads
# Megatron-Core with TransformerEngine fuses the pre-attention / pre-MLP norms into the next linear layer.
TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
# Megatron-Core's local layer spec saves its norms under TransformerEngine's fused names
# (`sharded_state_dict_keys_map`), so one checkpoint serves either implementation.
FUSED_NORM_NAMES = {ours: fused for fused, ours in TE_NAMES.items()}
# Megatron-Core's local linear layers keep an empty `_extra_state` (TransformerEngine compatibility) that a
# strict load expects; a GPT checkpoint leaves out the output layer's.
LINEAR_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
    "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2",
)
# Megatron-Core's keys of our MoE expert tensors (`models.moe.experts`, under a layer): SequentialMLP and
# TEGroupedMLP save every expert's Linear ([out, in]) on an expert axis of one key, the experts of every EP rank
# in one global tensor; our weights hold a layer's experts as [experts, in, out] (grouped_mm's layout).
EXPERT_KEYS = {
    "mlp.experts.weight1": "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.weight2": "mlp.experts.experts.linear_fc2.weight",
    "mlp.experts.bias1": "mlp.experts.experts.linear_fc1.bias",
    "mlp.experts.bias2": "mlp.experts.experts.linear_fc2.bias",
}
OUR_EXPERT_NAMES = {theirs: ours for ours, theirs in EXPERT_KEYS.items()}
TRANSPOSED_EXPERT_KEYS = ("mlp.experts.weight1", "mlp.experts.weight2")
EXPERT_LINEAR_MODULES = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.*)$")

MAX_DCP_METADATA_BYTES = 1 << 30  # DCP's index: about a kilobyte per tensor chunk
# What DCP's `.metadata` pickle may name: the classes DCP's metadata and planner modules define (Megatron-Core
# keeps its save plans there), and these few harmless globals.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


def stacked_layers(model: TransformerConfig) -> bool:
    """Megatron-Core stacks a layer stack's tensors on a first axis unless its layers differ: an MoE layer pattern
    with dense layers (Megatron's `non_homogeneous_layers`) saves every key per layer, `<stack>.layers.<i>.`."""
    return not model.is_moe or all(model.moe_layer_pattern)


@dataclass(frozen=True)
class CoreKey:
    """Where one of our global tensors lies in Megatron-Core's checkpoint: under `key`, after the leading axes
    `lead_shape` (the stacked layers) at `lead_offsets`; `transposed`: our expert weight [experts, in, out] is
    Megatron's Linears [experts, out, in]."""

    key: str
    lead_offsets: tuple[int, ...] = ()
    lead_shape: tuple[int, ...] = ()
    transposed: bool = False

    def place(
        self, block: torch.Tensor, offsets: Sequence[int], shape: Sequence[int]
    ) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
        """A block of our tensor (at `offsets` in a tensor of `shape`) as Megatron-Core's: a view of `block`, its
        offsets and the global shape under `key`."""
        offsets, shape = tuple(offsets), tuple(shape)
        if self.transposed:
            block = block.transpose(-1, -2)
            offsets = (*offsets[:-2], offsets[-1], offsets[-2])
            shape = (*shape[:-2], shape[-1], shape[-2])
        return (
            block[(None,) * len(self.lead_shape)],
            (*self.lead_offsets, *offsets),
            (*self.lead_shape, *shape),
        )


def core_key(name: str, num_layers: int, stacked: bool = True) -> CoreKey:
    """Megatron-Core's key of our global tensor `name`: a layer's tensor stacked (`decoder.layers.<name>` of shape
    [layers, ...], this layer at its index) or, not `stacked`, per layer; norms under their fused names, MoE
    experts under their Linears' key (`EXPERT_KEYS`); any other tensor keeps its name."""
    layer = _LAYER.match(name)
    if layer is None:
        return CoreKey(name)
    stack, index, local = layer.groups()
    theirs = EXPERT_KEYS.get(local) or FUSED_NORM_NAMES.get(local, local)
    transposed = local in TRANSPOSED_EXPERT_KEYS
    if stacked:
        return CoreKey(f"{stack}.layers.{theirs}", (int(index),), (num_layers,), transposed)
    return CoreKey(f"{stack}.layers.{index}.{theirs}", transposed=transposed)


def our_name(key: str) -> tuple[str, bool]:
    """Our name of Megatron-Core's per-layer key `key` (`<stack>.layers.<i>.<name>`, or a tensor outside the
    layers), and whether the tensor is transposed from ours (`CoreKey.transposed`)."""
    layer = _LAYER.match(key)
    if layer is None:
        return key, False
    stack, index, local = layer.groups()
    ours = OUR_EXPERT_NAMES.get(local) or TE_NAMES.get(local, local)
    return f"{stack}.layers.{index}.{ours}", ours in TRANSPOSED_EXPERT_KEYS


def extra_state_objects(
    core: CoreKey, experts: range = range(0), num_experts: int = 0
) -> dict[str, io.BytesIO]:
    """The empty `_extra_state` objects Megatron-Core keeps beside a linear layer's weight (at `core`), one per
    expert of `experts` (global indices of the layer's `num_experts`) for an MoE expert weight; none for other
    tensors: {key: bytes}. A key names its place, `<module>._extra_state/shard_<offsets>_<shape>` (Megatron's
    ShardedObject.unique_key; a per-layer key's offsets and shape are (0,) and (1,))."""
    module, _, tail = core.key.rpartition(".")
    if tail != "weight" or not module.endswith((*LINEAR_MODULES, *EXPERT_LINEAR_MODULES)):
        return {}
    places = [(core.lead_offsets, core.lead_shape)]
    if module.endswith(EXPERT_LINEAR_MODULES):
        places = [((*core.lead_offsets, e), (*core.lead_shape, num_experts)) for e in experts]
    objects = {}
    for offsets, shape in places:
        empty = io.BytesIO()
        torch.save([None], empty)
        at, size = ".".join(map(str, offsets or (0,))), ".".join(map(str, shape or (1,)))
        objects[f"{module}._extra_state/shard_{at}_{size}"] = empty
    return objects


def tp_pieces(
    local: torch.Tensor, sharding: TensorSharding, tp: int, tp_rank: int
) -> list[tuple[torch.Tensor, list[int]]]:
    """TP rank `tp_rank`'s shard `local` of a global tensor as contiguous pieces with their global offsets: itself
    for a replicated tensor or a plain split, one piece per part for a strided or packed one (fc1's gate and up
    halves, a Mamba mixer's in_proj parts)."""
    offsets = [0] * local.dim()
    if not sharding.is_split:
        return [(local, offsets)]
    dim, at = sharding.partition_dim, 0
    pieces = []
    for start, size in rank_pieces(
        local.shape[dim] * tp, tp, tp_rank, sharding.partition_stride, sharding.partition_sizes
    ):
        piece_offsets = list(offsets)
        piece_offsets[dim] = start
        pieces.append((local.narrow(dim, at, size), piece_offsets))
        at += size
    return pieces


def megatron_args(
    config: MegatronConfig, tp: int, pp: int, padded_vocab_size: int, iteration: int
) -> argparse.Namespace:
    """Megatron's args for a saved model: its model and tokenizer flags under Megatron's names (an MoE layer
    pattern as Megatron's int or list), the layout (the experts on one EP rank)."""
    model = dataclasses.asdict(config.model)
    if config.model.is_moe:
        pattern = config.model.moe_layer_pattern
        model["moe_layer_freq"] = 1 if all(pattern) else pattern
    return argparse.Namespace(
        **model,
        expert_model_parallel_size=1,
        **dataclasses.asdict(config.tokenizer),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        sequence_parallel=False,
        padded_vocab_size=padded_vocab_size,
        params_dtype=config.model.params_dtype,
        iteration=iteration,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        use_mcore_models=True,
        transformer_impl="local",  # input_layernorm / pre_mlp_layernorm names, not TE's fused ones
        ckpt_format="torch",
    )


@dataclass
class Chunk:
    """One rank's piece of a global tensor: its data at `offsets` in a tensor of `global_shape`."""

    data: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


class ChunkSavePlanner(DefaultSavePlanner):
    """The writes of one rank: its chunks (any offsets in their global tensors) and byte objects already
    serialised (Megatron's ShardedObjects), which are written as they are. The converter runs one per emulated
    rank without a process group; a training save, one per rank of the job."""

    def __init__(self, chunks: dict[str, list[Chunk]], objects: dict[str, io.BytesIO]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks, self.objects = chunks, objects

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(key, torch.Size(chunk.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(chunk.offsets), chunk.data.shape),
                    properties=TensorProperties.create_from_tensor(chunk.data),
                    size=torch.Size(chunk.global_shape),
                ),
            )
            for key, chunks in self.chunks.items()
            for chunk in chunks
        ]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.objects:
            return self.objects[index.fqn]
        return next(c.data for c in self.chunks[index.fqn] if torch.Size(c.offsets) == index.offset)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        return object


class RawBytesLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles byte objects with `weights_only=False`; this one copies the bytes into
    the BytesIO the caller passed, for `read_allowed_pickle` to read."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        target = self.state_dict[read_item.dest_index.fqn]
        target.write(value.read())
        target.seek(0)


class _RefusedClass(pickle.UnpicklingError):
    """A class `.metadata` names that DCP's metadata does not hold."""


class MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP's metadata and planner modules define, torch dtypes and
    `_METADATA_GLOBALS`; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        listed = (module, name) in _METADATA_GLOBALS
        if listed or module in (*_METADATA_MODULES, "torch"):
            found = super().find_class(module, name)
            defined_there = (
                module in _METADATA_MODULES and isinstance(found, type) and found.__module__ == module
            )
            if listed or isinstance(found, torch.dtype) or defined_there:
                return found
        raise _RefusedClass(f"{module}.{name}")


class SafeReader(dcp.FileSystemReader):
    """DCP's reader with `.metadata` unpickled through `MetadataUnpickler` (DCP uses plain `pickle.load`), a
    regular file of a bounded size."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(str(self.path), ".metadata")
        if not os.path.exists(path):
            raise CheckpointError(
                f"{path} is missing: {self.path} is not a complete torch_dist checkpoint (an interrupted save?); "
                "load another iteration (--ckpt-step N) or copy the folder again"
            )
        if not os.path.isfile(path):  # a FIFO or a device would block the read or never end it
            raise CheckpointError(f"{path} is not a regular file; the save is damaged")
        size = os.path.getsize(path)
        if size > MAX_DCP_METADATA_BYTES:
            raise CheckpointError(
                f"{path}: {size} bytes, over the {MAX_DCP_METADATA_BYTES} bytes a DCP index may have; it is not "
                "the index of a checkpoint"
            )
        with open(path, "rb") as handle:
            try:
                metadata = MetadataUnpickler(handle).load()
            except _RefusedClass as error:
                raise CheckpointError(
                    f"{path} names {error}, which DCP metadata does not hold; unpickling it could run code, so "
                    "it is not loaded"
                ) from error
            except (
                pickle.UnpicklingError,
                EOFError,
                ValueError,
                TypeError,
                AttributeError,
                IndexError,
                KeyError,
                RecursionError,
            ) as error:
                raise CheckpointError(
                    f"{path} is not a DCP index ({error!r}); the save is damaged"
                ) from error
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata")
        self.storage_data = metadata.storage_data
        return metadata


@dataclass
class Destination:
    """Where a block of a saved global tensor goes: `tensor` (a view this rank fills) receives the block of
    key `key` at `offsets` of the saved tensor, of `tensor`'s shape."""

    key: str
    offsets: tuple[int, ...]
    tensor: torch.Tensor


class ChunkLoadPlanner(LoadPlanner):
    """Reads blocks of saved global tensors into destination views, and byte objects into BytesIO (never
    unpickled here). Blocks may cut the saved chunks any way: DCP reads the overlapping parts of each."""

    def __init__(self, destinations: list[Destination], objects: dict[str, io.BytesIO] | None = None) -> None:
        self.destinations = {(d.key, tuple(d.offsets)): d.tensor for d in destinations}
        self.objects = objects or {}

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for (key, offsets), tensor in self.destinations.items():
            saved = self.metadata.state_dict_metadata.get(key)
            if not isinstance(saved, TensorStorageMetadata):
                raise CheckpointError(f"the checkpoint holds no tensor {key!r}")
            chunk = ChunkStorageMetadata(torch.Size(offsets), tensor.shape)
            items += create_read_items_for_chunk_list(key, saved, [chunk])
        for key in self.objects:
            items += [ReadItem(
                type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key), dest_offsets=torch.Size((0,)),
                storage_index=MetadataIndex(key), storage_offsets=torch.Size((0,)), lengths=torch.Size((0,)),
            )]  # fmt: skip
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        target = self.objects[read_item.dest_index.fqn]
        target.write(value.read())
        target.seek(0)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor = self.destinations[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """DCP copied the block into the view `resolve_tensor` gave (or gives it back when it was not one)."""
        target = self.resolve_tensor(read_item)
        if tensor.data_ptr() != target.data_ptr():
            target.copy_(tensor)
