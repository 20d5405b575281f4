"""The `torch_dist` loader and saver: Megatron-Core's distributed checkpoint (PyTorch DCP).

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000100/metadata.json    {"sharded_backend": "torch_dist", ...}, written last
    <dir>/iter_0000100/.metadata         DCP's index: every key's global shape, its chunks, where they lie
    <dir>/iter_0000100/__R_0.distcp      the chunks global rank R (TP fastest, then PP) wrote
    <dir>/iter_0000100/common.pt         the common state (args, iteration); the newest Megatron-Core may keep
                                         it as the `common_state` object of the DCP folder instead

Megatron-Core saves `GPTModel.sharded_state_dict()`: each tensor under its key with its global shape, each rank
writing the chunks it holds. Layers are stacked: `decoder.layers.<name>` has the global layer as its first
axis (`decoder.layers.<i>.<name>` per layer with `non_homogeneous_layers`); the pre-attention and pre-MLP norms
go by TransformerEngine's fused names (`self_attention.linear_qkv.layer_norm_weight`, as Megatron-Core's local
spec maps them too); SwiGLU's fc1 is the whole model's
[gate; up], so a rank writes two chunks of it; the vocabulary tensors keep their padded rows; a tied output
layer is saved once, as the embedding. MoE experts are every expert's Linear on an expert axis
(`mlp.experts.experts.linear_fc1.weight`, [layers, experts, out, in]); a model of dense and MoE layers has every
key per layer. The common state (args, iteration) is torch.save'd bytes, read through
the `megatron` format's allow-list; DCP's own `.metadata` pickle is read with an unpickler that knows only
DCP's metadata classes, so a crafted checkpoint runs nothing (docs/architecture.md, checkpoints).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import TRACKER_FILENAME, CheckpointError, checkpoint_dir
from megatron_train.checkpointing.dcp import (
    CHECKPOINT_VERSION,
    Chunk,
    ChunkSavePlanner,
    RawBytesLoadPlanner,
    SafeReader,
    core_key,
    extra_state_objects,
    our_name,
    stacked_layers,
    tp_pieces,
)
from megatron_train.checkpointing.layout import TensorSharding, split_tp_shard, stage_tensor_names
from megatron_train.convert.checks import check_byte_budget, check_layers
from megatron_train.convert.megatron import (
    check_model_args,
    checked_args,
    config_from_args,
    find_iteration_dir,
    megatron_args,
    megatron_names,
    read_allowed_pickle,
    read_checkpoint_file,
    save_torch,
)
from megatron_train.convert.source import read_json_object
from megatron_train.convert.target import output_folder
from megatron_train.convert.tokenizer_files import copy_tokenizer, tokenizer_sources
from megatron_train.convert.weights import (
    ModelWeights,
    check_tensor_names,
    model_shapes,
    model_shardings,
    pad_vocab,
    padded_size_of,
    padded_vocab_for_layout,
    trim_vocab,
)
from megatron_train.families.family import MegatronNames, ModelFamily
from megatron_train.models.config import TransformerConfig
from storage.atomic import atomic_write_text

CONFIG_FILE = "metadata.json"
BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
COMMON_STATE_KEY = "common_state/shard_0_1"  # Megatron's ShardedObject("common_state", (1,), (0,)).unique_key
COMMON_FILE = "common.pt"
MAX_METADATA_JSON_BYTES = 1 << 20  # metadata.json names the backend: a few dozen bytes
_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.*)$")
_STACKED = re.compile(r"^(decoder|encoder)\.layers\.(?!\d+\.)(.*)$")
# An optimizer tensor in model space: (chained_<i>.)optimizer.state.<state>.<model key>
_OPTIMIZER_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.([^.]+)\.(.+)$")
MODEL_PREFIXES = (
    "embedding.",
    "decoder.",
    "encoder.",
    "output_layer.",
    "lm_head.",
    "pooler.",
    "binary_head.",
)


def _load_in_one_process(state: dict[str, Any], reader: SafeReader, planner: DefaultLoadPlanner) -> None:
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is what we mean
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)


def _read_objects(reader: SafeReader, keys: list[str]) -> dict[str, io.BytesIO]:
    objects: dict[str, Any] = {key: io.BytesIO() for key in keys}
    _load_in_one_process(objects, reader, RawBytesLoadPlanner())
    return objects


def _common_state(iteration_dir: str, reader: SafeReader, metadata: Metadata) -> dict[str, Any]:
    """The non-tensor part Megatron saved (args, iteration, ...): common.pt, or the `common_state` object."""
    legacy = os.path.join(iteration_dir, COMMON_FILE)
    if os.path.exists(legacy):
        return read_checkpoint_file(legacy)
    if COMMON_STATE_KEY not in metadata.state_dict_metadata:
        raise CheckpointError(
            f"{iteration_dir} holds neither {COMMON_FILE} nor the {COMMON_STATE_KEY!r} object: its args "
            "are unknown; is it a Megatron-Core torch_dist checkpoint?"
        )
    raw = _read_objects(reader, [COMMON_STATE_KEY])[COMMON_STATE_KEY]
    return read_allowed_pickle(raw, f"{iteration_dir} ({COMMON_STATE_KEY})")[0]


@dataclass
class DistCheckpoint:
    """One iteration of a Megatron-Core torch_dist checkpoint: its DCP index and common state read, tensors not yet."""

    iteration_dir: str
    iteration: int
    common: dict[str, Any]  # args, iteration, opt_param_scheduler, ... as Megatron saved them
    reader: SafeReader
    metadata: Metadata

    @property
    def args(self) -> Any:
        return self.common["args"]

    def weights(self, true_vocab_size: int | None, family: ModelFamily) -> ModelWeights:
        """The model of `family` at any saved layout, its vocabulary cut to `true_vocab_size`. The args are
        checked against DCP's index (`_check_index`) before a tensor is allocated."""
        layer_stack = torch_dist_names(family, "--loader torch_dist").layer_stack
        config = config_from_args(self.args, true_vocab_size, self.iteration_dir)
        keys = {key: key for key in self._tensor_keys() if key.startswith(MODEL_PREFIXES)}
        items = self.metadata.state_dict_metadata
        _check_index({key: items[key] for key in keys}, config, self.args.padded_vocab_size, family,
                     self.iteration_dir)  # fmt: skip
        tensors = self._read_tensors(keys)
        check_layers(config.model.num_layers, tensors, f"{layer_stack}.layers.", "args.num_layers",
                     self.iteration_dir, f"{self.iteration_dir}/.metadata")  # fmt: skip
        check_tensor_names(
            tensors,
            list(model_shardings(config, self.args.padded_vocab_size, family, self.iteration_dir)),
            self.iteration_dir,
        )
        return ModelWeights(
            config,
            trim_vocab(tensors, config.model.true_vocab_size),
            tokenizer_sources(config.tokenizer, os.path.dirname(self.iteration_dir)),
            self.iteration,
            family=family,
        )

    def optimizer_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """{our param name: {state: tensor}} of the optimizer state saved in model space, as Megatron-Core's
        Adam (`optimizer.state.<state>.<model key>`: exp_avg, exp_avg_sq, fp32_param) and its distributed
        optimizer's fully reshardable format (`param`, the fp32 main param) write it, a ChainedOptimizer's under
        `chained_<i>.` or not; empty for other layouts."""
        keys = {}
        for key in self._tensor_keys():
            found = _OPTIMIZER_KEY.match(key)
            if found and found[2].startswith(MODEL_PREFIXES):
                keys[key] = f"{found[2]}\0{found[1]}"  # the model key, then the state's name
        states: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in self._read_tensors(keys).items():
            param, state = name.split("\0")
            states.setdefault(param, {})[state] = tensor
        return states

    def _tensor_keys(self) -> list[str]:
        return [
            key
            for key, item in self.metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
        ]

    def _read_tensors(self, keys: dict[str, str]) -> dict[str, torch.Tensor]:
        """The tensors of DCP `keys`, each under its name (`keys[key]`, a model key with anything after it) made
        ours: stacked layers split into `<stack>.layers.<i>.`, TransformerEngine's fused norm names renamed, MoE
        experts' Linears as our expert weights (`checkpointing.dcp.our_name`)."""
        items = self.metadata.state_dict_metadata
        loaded = {key: torch.empty(tuple(items[key].size), dtype=items[key].properties.dtype) for key in keys}
        _load_in_one_process(loaded, self.reader, DefaultLoadPlanner(flatten_state_dict=False))
        tensors: dict[str, torch.Tensor] = {}
        for key, tensor in loaded.items():
            stacked = _STACKED.match(keys[key])
            if stacked:
                stack, name = stacked.groups()
                per_layer = {f"{stack}.layers.{layer}.{name}": part for layer, part in enumerate(tensor)}
            else:
                per_layer = {keys[key]: tensor}
            for name, part in per_layer.items():
                # the model key is renamed, not the state name after it
                model_key, separator, rest = name.partition("\0")
                ours, transposed = our_name(model_key)
                tensors[ours + separator + rest] = (
                    part.transpose(-1, -2).contiguous() if transposed else part.clone()
                )
        return tensors


def open_checkpoint(load_dir: str, iteration: int | None = None) -> DistCheckpoint:
    """`load_dir`'s iteration (latest, or `iteration`): its backend checked, its index and common state read, the
    args checked (types, sizes) and the index's tensors checked to fit the bytes of the `.distcp` files."""
    iteration_dir, number = find_iteration_dir(load_dir, iteration)
    config_path = os.path.join(iteration_dir, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise CheckpointError(
            f"{config_path} is missing: {iteration_dir} is not a distributed checkpoint (--loader megatron reads "
            "the legacy torch format)"
        )
    backend = read_json_object(config_path, MAX_METADATA_JSON_BYTES).get("sharded_backend")
    if backend != "torch_dist":
        raise CheckpointError(f"{config_path}: sharded_backend {backend!r} is not torch_dist")
    reader = SafeReader(iteration_dir)
    metadata = reader.read_metadata()
    common = _common_state(iteration_dir, reader, metadata)
    if not isinstance(common, dict) or "args" not in common:
        raise CheckpointError(
            f"{iteration_dir}: the common state holds no args; its model's shape is unknown"
        )
    check_model_args(checked_args(common["args"], f"{iteration_dir} ({COMMON_FILE})"), iteration_dir)
    file_bytes = sum(
        entry.stat().st_size for entry in os.scandir(iteration_dir) if entry.name.endswith(".distcp")
    )
    tensor_bytes = sum(
        math.prod(item.size) * torch.empty(0, dtype=item.properties.dtype).element_size()
        for item in metadata.state_dict_metadata.values()
        if isinstance(item, TensorStorageMetadata)
    )
    check_byte_budget(tensor_bytes, file_bytes, f"{iteration_dir}/.metadata")
    return DistCheckpoint(iteration_dir, number, common, reader, metadata)


def load(
    load_dir: str, iteration: int | None, true_vocab_size: int | None, family: ModelFamily
) -> ModelWeights:
    """The model of `family` in a Megatron-Core torch_dist checkpoint (latest, or `iteration`), at any saved
    layout."""
    return open_checkpoint(load_dir, iteration).weights(true_vocab_size, family)


def _check_index(
    items: dict[str, TensorStorageMetadata],
    config: MegatronConfig,
    padded_vocab_size: int,
    family: ModelFamily,
    iteration_dir: str,
) -> None:
    """DCP's index of the model's tensors against the args, before anything is allocated: each tensor's shape is
    the one the args give a layer (or the embedding, the output layer) of, and every stacked tensor has
    args.num_layers layers."""
    where = f"{iteration_dir}/.metadata"
    expected = {
        kind: _one_layer_shapes(config, kind, padded_vocab_size, family, iteration_dir) for kind in (0, 1)
    }
    for key, item in items.items():
        size, stacked = tuple(item.size), _STACKED.match(key)
        if stacked:
            name, transposed = our_name(f"{stacked.group(1)}.layers.0.{stacked.group(2)}")
            if not size or size[0] != config.model.num_layers:
                raise CheckpointError(
                    f"{where}: {key} stacks {size[0] if size else 0} layers, but args.num_layers is "
                    f"{config.model.num_layers}; the args and the weights come from different models"
                )
            size, kind = size[1:], int(config.model.is_moe)
        else:
            layer = _LAYER.match(key)
            index = int(layer.group(2)) if layer else 0
            name, transposed = our_name(f"{layer.group(1)}.layers.0.{layer.group(3)}" if layer else key)
            kind = int(config.model.is_moe_layer(index)) if index < config.model.num_layers else 0
        want = expected[kind].get(name)
        if (
            want is not None and transposed
        ):  # our expert weight [experts, in, out], Megatron's Linears' [.., out, in]
            want = (*want[:-2], want[-1], want[-2])
        if want is not None and size != want:
            raise CheckpointError(
                f"{where}: {key} has shape {list(item.size)}, but the args (hidden_size, num_attention_heads, "
                f"ffn_hidden_size, num_experts, moe_ffn_hidden_size, padded_vocab_size, ...) make it {list(want)}; "
                "the args and the weights come from different models"
            )


def _one_layer_shapes(
    config: MegatronConfig, moe: int, padded_vocab_size: int, family: ModelFamily, iteration_dir: str
) -> dict[str, tuple[int, ...]]:
    """Our tensors' shapes in a one-layer model of the args: its layer dense, or (`moe` 1, an MoE model) an MoE
    layer."""
    layer = {"num_layers": 1, **({"moe_layer_freq": str([moe])} if config.model.is_moe else {})}
    try:  # a layer pattern that cannot hold one layer refuses it: the args disagree
        one_layer = dataclasses.replace(config, model=dataclasses.replace(config.model, **layer))
    except ValueError as error:
        raise CheckpointError(f"{iteration_dir}/{COMMON_FILE} (args): {error}") from None
    return model_shapes(one_layer, padded_vocab_size, family, f"{iteration_dir}/.metadata")


def torch_dist_names(family: ModelFamily, flag: str) -> MegatronNames:
    """The family's Megatron names, refused naming `flag` where its layers are not in the torch_dist mapping."""
    names = megatron_names(family, flag)
    if names.torch_dist is not None:
        raise ValueError(f"{flag}: the {family.name} family: {names.torch_dist}")
    return names


def _rank_state(
    tensors: dict[str, torch.Tensor],
    shardings: dict[str, TensorSharding],
    names: list[str],
    model: TransformerConfig,
    tp: int,
    tp_rank: int,
) -> tuple[dict[str, list[Chunk]], dict[str, io.BytesIO]]:
    """One (TP, PP) rank's chunks under Megatron-Core's keys (`checkpointing.dcp.core_key`; an MoE layer's experts
    split over TP as expert TP, the Megatron default), and its empty `_extra_state` objects; TP rank 0 writes the
    replicated tensors."""
    chunks: dict[str, list[Chunk]] = {}
    objects: dict[str, io.BytesIO] = {}
    for name in names:
        tensor, sharding = tensors[name], shardings[name]
        if not sharding.is_split and tp_rank:
            continue
        core = core_key(name, model.num_layers, stacked_layers(model))
        local = split_tp_shard(tensor, sharding, tp, tp_rank, name)
        for data, offsets in tp_pieces(local, sharding, tp, tp_rank):
            view, at, shape = core.place(data, offsets, tensor.shape)
            chunks.setdefault(core.key, []).append(Chunk(view.contiguous(), at, shape))
        if tp_rank == 0:
            objects.update(extra_state_objects(core, range(model.num_experts or 0), model.num_experts or 0))
    return chunks, objects


def save(
    weights: ModelWeights, save_dir: str, target_tp: int = 1, target_pp: int = 1, overwrite: bool = False
) -> str:
    """Write `weights` as Megatron-Core would save them from (target_tp, target_pp) ranks, built beside
    `save_dir` and moved into place whole (`convert.target`); returns the iteration folder."""
    config = weights.config
    torch_dist_names(weights.family, "--saver torch_dist")
    padded = padded_vocab_for_layout(weights, target_tp, target_pp)
    with output_folder(save_dir, overwrite, padded_size_of(weights, padded)) as out:
        config.tokenizer = copy_tokenizer(config.tokenizer, weights.tokenizer_files, out, save_dir)
        _write(weights, out, target_tp, target_pp, padded)
    return checkpoint_dir(save_dir, weights.iteration)


def _write(weights: ModelWeights, root: str, target_tp: int, target_pp: int, padded: int) -> None:
    """Every rank's `.distcp` file and DCP's index, common.pt, metadata.json and the latest marker, into the
    folder `root`."""
    config = weights.config
    iteration_dir = checkpoint_dir(root, weights.iteration)
    tensors = pad_vocab(weights.tensors, padded)
    shardings = model_shardings(config, padded, weights.family)
    args = megatron_args(weights, target_tp, target_pp, padded)
    args.ckpt_format = "torch_dist"
    split = weights.family.pipeline
    planners, writers, plans = [], [], []
    for pp_rank in range(target_pp):
        layers = split.layer_range(config.model, pp_rank, target_pp)
        names = stage_tensor_names(split, list(shardings), layers, pp_rank == 0, pp_rank == target_pp - 1)
        for tp_rank in range(target_tp):
            rank = pp_rank * target_tp + tp_rank
            chunks, objects = _rank_state(tensors, shardings, names, config.model, target_tp, tp_rank)
            planner, writer = ChunkSavePlanner(chunks, objects), dcp.FileSystemWriter(iteration_dir)
            planner.set_up_planner({}, writer.storage_meta(), is_coordinator=rank == 0)
            writer.set_up_storage_writer(rank == 0, rank=rank)
            plans.append(writer.prepare_local_plan(planner.create_local_plan()))
            planners.append(planner)
            writers.append(writer)
    # what DCP's coordinator does with every rank's plan: check they tile each tensor, name the files
    global_plans, metadata = planners[0].create_global_plan(plans)
    global_plans = writers[0].prepare_global_plan(global_plans)
    results = []
    for rank, (planner, writer, plan) in enumerate(zip(planners, writers, global_plans, strict=True)):
        try:
            results.append(writer.write_data(planner.finish_plan(plan), planner).value())
        except OSError as error:  # DCP's writer names no file
            path = os.path.join(iteration_dir, f"__{rank}_0.distcp")
            raise OSError(error.errno, error.strerror or str(error), path) from error
    writers[0].finish(metadata, results)
    # common.pt, which every Megatron-Core reads (newer ones also read a `common_state` object instead)
    save_torch(
        {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": weights.iteration,
         "num_floating_point_operations_so_far": 0},
        os.path.join(iteration_dir, COMMON_FILE),
    )  # fmt: skip
    atomic_write_text(os.path.join(iteration_dir, CONFIG_FILE), json.dumps(BACKEND))
    atomic_write_text(os.path.join(root, TRACKER_FILENAME), str(weights.iteration))
