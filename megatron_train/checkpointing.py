"""Save and load training checkpoints: safetensors for tensors, JSON for everything else, no pickles.

Layout of a run directory (Megatron's names where Megatron has them):

    <save>/latest_checkpointed_iteration.txt     written atomically, only after the folder is complete
    <save>/iter_0000100/metadata.json            iteration, consumed samples, args, layout, scheduler (last)
    <save>/iter_0000100/mp_rank_00[_000]/model.safetensors     this (TP, PP) rank's shard of the weights
    <save>/iter_0000100/mp_rank_00[_000]/optimizer.safetensors fp32 main params and Adam moments (DP rank 0)
    <save>/iter_0000100/mp_rank_00[_000]/optimizer.json        step counts, param groups, loss scaler
    <save>/iter_0000100/rng/rank_00000.safetensors / .json     every rank's python, numpy, torch, CUDA and
                                                               model-parallel-tracker RNG states

Tensors are stored under global names (`decoder.layers.<global layer>.`), each with its global shape and its
TP split (Megatron's tensor_model_parallel, partition_dim, partition_stride) and PP stage in the safetensors
metadata; optimizer tensors are `<param name>.<state>` (main_param, exp_avg, exp_avg_sq) and shard like their
param. So a checkpoint saved under one (TP, PP, DP) layout loads under another: each rank reads all TP shards
of the tensors it holds, merges them and keeps its slice (`checkpoint_layout`). RNG states are per rank and
load only when (TP, PP) is unchanged, as in Megatron; `tools/checkpoint_util.py` reshards offline.

Interleaved pipelines (--num-layers-per-virtual-pipeline-stage) save and load a LIST of model chunks: a rank's
shard file holds all its chunks' tensors, each under its global name (chunk c's layers come from
`get_layer_range(..., c, virtual size)`), and optimizer state keyed `<chunk>.<name>` maps to the same names.
Loading finds every tensor by its record, whichever file holds it, so the format is the same with or without
virtual stages: a checkpoint saved with them loads without them (any TP, PP) and vice versa.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from megatron_train.arguments import MegatronConfig, config_from_dict, config_to_dict
from megatron_train.checkpoint_layout import (
    OUTPUT_WEIGHT,
    VOCAB_PARAMS,
    WORD_EMBEDDING,
    TensorSharding,
    global_param_name,
    layer_number,
    merge_tp_shards,
    module_order,
    padded_vocab_sizes_agree,
    resize_vocab,
    split_tp_shard,
    true_vocab_range,
)
from megatron_train.models.transformer import get_layer_range
from megatron_train.parallel import state
from megatron_train.parallel.random import get_rng_tracker

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: global layer names and PP stage records, any (TP, PP) layout loads
# Version 1 wrote only PP = 1 checkpoints, whose names and records version 2 reads unchanged.
READABLE_FORMAT_VERSIONS = (1, 2)
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
METADATA_FILENAME = "metadata.json"
# Model settings that change the weights' shapes or meaning: a checkpoint must agree on all of them.
MODEL_ARGS_TO_CHECK = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "kv_channels",
    "group_query_attention",
    "num_query_groups",
    "max_position_embeddings",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: the message names the file and what to do."""


@dataclass
class TrainingProgress:
    """What the training loop resumes from."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def model_shard_dir(iteration_dir: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron's per-model-parallel-rank folder name: mp_rank_<tp>[_<pp>]."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(iteration_dir, name)


def _this_shard_dir(iteration_dir: str) -> str:
    return model_shard_dir(
        iteration_dir,
        state.get_tensor_model_parallel_rank(),
        state.get_pipeline_model_parallel_rank(),
        state.get_pipeline_model_parallel_world_size(),
    )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _atomic_save_tensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
    os.replace(tmp, path)


def _missing_file_error(path: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path} is missing: the save did not finish or files were moved")


def _open_tensors(path: str) -> Any:
    """A lazy safetensors handle (header checked, tensors read on demand), or an actionable CheckpointError."""
    if not os.path.exists(path):
        raise _missing_file_error(path)
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint file {path} is corrupt ({error}); load an earlier iteration with --ckpt-step "
            "or delete this iteration folder"
        ) from error


def _load_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (a damaged file raises CheckpointError)."""
    _open_tensors(path)
    return load_file(path)


def _read_json(path: str) -> Any:
    if not os.path.exists(path):
        raise _missing_file_error(path)
    try:
        with open(path) as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON ({error})") from error


def sharding_record(
    global_shape: list[int],
    sharding: TensorSharding,
    sequence_parallel: bool,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    name: str,
) -> dict[str, Any]:
    """What a shard file records of one tensor: global shape, TP split, and PP stage and global layer."""
    return {
        "global_shape": global_shape,
        "tensor_model_parallel": sharding.is_split,
        "partition_dim": sharding.partition_dim,
        "partition_stride": sharding.partition_stride,
        "sequence_parallel": sequence_parallel,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "pp_rank": pp_rank,
        "pp_size": pp_size,
        "layer": layer_number(name),
    }


def write_shard(
    shard_dir: str,
    weights: dict[str, torch.Tensor],
    sharding: dict[str, dict[str, Any]],
    optimizer_state: tuple[dict[str, torch.Tensor], dict] | None,
) -> None:
    """One (TP, PP) rank's files: model.safetensors and, given optimizer state, optimizer.safetensors/.json."""
    os.makedirs(shard_dir, exist_ok=True)
    metadata = {"format_version": str(FORMAT_VERSION), "sharding": json.dumps(sharding)}
    _atomic_save_tensors(weights, os.path.join(shard_dir, "model.safetensors"), metadata)
    if optimizer_state is not None:
        tensors, meta = optimizer_state
        if tensors:  # safetensors cannot read back an empty file (an optimizer that never stepped)
            _atomic_save_tensors(tensors, os.path.join(shard_dir, "optimizer.safetensors"), metadata)
        _atomic_write_text(os.path.join(shard_dir, "optimizer.json"), json.dumps(meta))


def write_metadata_and_marker(root: str, iteration: int, metadata: dict[str, Any]) -> None:
    """Complete a saved iteration: metadata.json, then the latest marker (never before the folder is whole)."""
    _atomic_write_text(
        os.path.join(checkpoint_dir(root, iteration), METADATA_FILENAME), json.dumps(metadata, indent=1)
    )
    _atomic_write_text(os.path.join(root, TRACKER_FILENAME), str(iteration))


StageModel = torch.nn.Module | Sequence[torch.nn.Module]  # one pipeline stage, or its virtual-stage chunks


def _stage_module(model: StageModel) -> torch.nn.Module:
    """The stage as one module: itself, or its chunks in a ModuleList, whose names `<chunk>.<name>` are the
    ones the optimizer gives the params of several chunks."""
    chunks = _chunks(model)
    return chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)


def _chunks(model: StageModel) -> list[torch.nn.Module]:
    return [model] if isinstance(model, torch.nn.Module) else list(model)


def _global_names(model: StageModel, config: MegatronConfig) -> dict[str, str]:
    """This pipeline stage's state-dict names (`<chunk>.<name>` for several chunks) -> checkpoint names: global
    layer numbers from each chunk's layer range, a tied output layer off the first stage -> the word embedding."""
    chunks = _chunks(model)
    virtual_size = state.get_virtual_pipeline_model_parallel_world_size()
    if len(chunks) != (virtual_size or 1):
        raise CheckpointError(
            f"got {len(chunks)} model chunks but this run has {virtual_size or 1} virtual pipeline stages per "
            "rank (--num-layers-per-virtual-pipeline-stage): pass one chunk per virtual stage, in order"
        )
    pp_rank = state.get_pipeline_model_parallel_rank()
    pp_size = state.get_pipeline_model_parallel_world_size()
    tied = not config.model.untie_embeddings_and_output_weights
    names = {}
    for virtual_rank, chunk in enumerate(chunks):
        layers = get_layer_range(config.model.num_layers, pp_rank, pp_size, virtual_rank, virtual_size)
        tied_copy = tied and (pp_rank, virtual_rank) != (0, 0)
        prefix = f"{virtual_rank}." if len(chunks) > 1 else ""
        for name in chunk.state_dict():
            names[prefix + name] = global_param_name(name, layers.start, tied_copy)
    return names


def _owned(names: dict[str, str]) -> dict[str, str]:
    """Drop the tied output copy: the stage holding the word embedding saves it."""
    return {
        local: name
        for local, name in names.items()
        if not (name == WORD_EMBEDDING and local.endswith(OUTPUT_WEIGHT))
    }


def _sharding_info(model: torch.nn.Module, names: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per saved tensor: its record (Megatron's param attributes tell the TP split)."""
    tp_size = state.get_tensor_model_parallel_world_size()
    params = dict(model.named_parameters())
    weights = model.state_dict()
    info = {}
    for local, name in names.items():
        param = params.get(local)
        split = bool(getattr(param, "tensor_model_parallel", False))
        sharding = TensorSharding(
            int(param.partition_dim) if split else -1, int(getattr(param, "partition_stride", 1))
        )
        global_shape = list(weights[local].shape)
        if split:
            global_shape[sharding.partition_dim] *= tp_size
        info[name] = sharding_record(
            global_shape,
            sharding,
            bool(getattr(param, "sequence_parallel", False)),
            state.get_tensor_model_parallel_rank(),
            tp_size,
            state.get_pipeline_model_parallel_rank(),
            state.get_pipeline_model_parallel_world_size(),
            name,
        )
    return info


def _rename_optimizer_state(
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


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{index}"] = cuda_state
    for name, tracker_state in get_rng_tracker().get_states().items():
        tensors[f"tracker/{name}"] = tracker_state
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    meta = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    return tensors, meta


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in sorted(tensors) if k.startswith("cuda_")])
    tracker = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("tracker/")}
    if tracker:
        get_rng_tracker().set_states(tracker)
    py_version, py_state, py_gauss = meta["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = meta["numpy"]
    np.random.set_state((np_kind, np.array(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))


def save_checkpoint(
    iteration: int,
    model: StageModel,
    optimizer: Any | None,
    opt_param_scheduler: Any | None,
    loaded: TrainingProgress,
    config: MegatronConfig,
    padded_vocab_size: int,
) -> str:
    """Every rank writes its part; rank 0 writes metadata.json and then the latest marker. Returns the folder.

    `model` is the unwrapped module of this pipeline stage, or the list of its chunks (one per virtual stage,
    in order) when interleaved; `loaded` carries the consumed sample counts to store.
    """
    names = _owned(_global_names(model, config))
    model = _stage_module(model)
    root = config.checkpoint.save
    iteration_dir = checkpoint_dir(root, iteration)
    os.makedirs(os.path.join(iteration_dir, "rng"), exist_ok=True)
    optimizer_state = None
    if optimizer is not None and not config.checkpoint.no_save_optim:
        # every DP rank asks: a distributed optimizer gathers its shards into per-param tensors here
        optimizer_state = _rename_optimizer_state(*optimizer.state_dict(), names)
    if state.get_data_parallel_rank() == 0:
        weights = {names[local]: tensor for local, tensor in model.state_dict().items() if local in names}
        write_shard(_this_shard_dir(iteration_dir), weights, _sharding_info(model, names), optimizer_state)
    if not config.checkpoint.no_save_rng:
        tensors, meta = _rng_state()
        rng_prefix = os.path.join(iteration_dir, "rng", f"rank_{_rank():05d}")
        _atomic_save_tensors(tensors, rng_prefix + ".safetensors", {})
        _atomic_write_text(rng_prefix + ".json", json.dumps(meta))
    _barrier()
    if _rank() == 0:
        metadata = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "consumed_train_samples": loaded.consumed_train_samples,
            "consumed_valid_samples": loaded.consumed_valid_samples,
            "padded_vocab_size": padded_vocab_size,
            # the tokenizer's vocabulary size is low < V <= high: what a later layout may re-pad from
            "true_vocab_size_range": true_vocab_range(
                padded_vocab_size,
                config.tokenizer.make_vocab_size_divisible_by * state.get_tensor_model_parallel_world_size(),
            ),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "tensor_model_parallel_size": state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": state.get_pipeline_model_parallel_world_size(),
            # informative only: loading does not depend on it
            "virtual_pipeline_model_parallel_size": state.get_virtual_pipeline_model_parallel_world_size(),
            "data_parallel_size": state.get_data_parallel_world_size(),
            "opt_param_scheduler": opt_param_scheduler.state_dict()
            if opt_param_scheduler is not None
            else None,
            "args": config_to_dict(config),
        }
        write_metadata_and_marker(root, iteration, metadata)
    _barrier()
    logger.info("saved checkpoint at iteration %d to %s", iteration, iteration_dir)
    return iteration_dir


def read_latest_iteration(load_dir: str) -> int | None:
    """The iteration in the latest marker, None when there is none (nothing saved yet)."""
    path = os.path.join(load_dir, TRACKER_FILENAME)
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        text = handle.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number but holds {text[:40]!r}")
    return int(text)


def resolve_iteration_dir(load_dir: str, iteration: int | None) -> str | None:
    """The folder of `iteration` (default: the latest marker's) in `load_dir`; None when nothing was saved."""
    if iteration is None:
        iteration = read_latest_iteration(load_dir)
        if iteration is None:
            return None
    iteration_dir = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(iteration_dir):
        saved = (
            sorted(d for d in os.listdir(load_dir) if d.startswith("iter_"))
            if os.path.isdir(load_dir)
            else []
        )
        raise CheckpointError(f"checkpoint folder {iteration_dir} does not exist (iterations there: {saved})")
    return iteration_dir


def read_metadata(iteration_dir: str) -> dict:
    metadata = _read_json(os.path.join(iteration_dir, METADATA_FILENAME))
    if metadata.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise CheckpointError(
            f"{iteration_dir}/{METADATA_FILENAME}: format version {metadata.get('format_version')} is not one "
            f"this code reads ({READABLE_FORMAT_VERSIONS}); convert it with the code version that wrote it"
        )
    return metadata


def saved_true_vocab_range(metadata: dict) -> tuple[int, int]:
    """The range of true vocabulary sizes a checkpoint's padded vocabulary allows (older ones: from its TP)."""
    if "true_vocab_size_range" in metadata:
        return tuple(metadata["true_vocab_size_range"])
    divisor = metadata["args"].get("tokenizer", {}).get("make_vocab_size_divisible_by", 128)
    return true_vocab_range(metadata["padded_vocab_size"], divisor * metadata["tensor_model_parallel_size"])


class SavedCheckpoint:
    """One saved iteration seen as global tensors, whatever (TP, PP) layout wrote it.

    Opening reads metadata.json and each pipeline stage's shard header; tensors are read only when asked
    for, from the TP shards that hold them.
    """

    def __init__(self, iteration_dir: str) -> None:
        self.iteration_dir = iteration_dir
        self.metadata = read_metadata(iteration_dir)
        self.tp_size: int = self.metadata["tensor_model_parallel_size"]
        self.pp_size: int = self.metadata["pipeline_model_parallel_size"]
        self.padded_vocab_size: int = self.metadata["padded_vocab_size"]
        self._handles: dict[str, Any] = {}
        self._saved_optimizer: tuple[dict, set[str]] | None = None
        records: dict[str, dict[str, Any]] = {}
        for pp_rank in range(self.pp_size):
            path = self.path("model", 0, pp_rank)
            records.update(json.loads((self._handle(path).metadata() or {}).get("sharding", "{}")))
        # checkpoint name -> record, in model order (an interleaved pipeline's stages hold layers out of order)
        self.params: dict[str, dict[str, Any]] = {
            name: records[name] for name in sorted(records, key=module_order)
        }

    def path(self, kind: str, tp_rank: int, pp_rank: int) -> str:
        """`kind` is "model" or "optimizer"."""
        return os.path.join(
            model_shard_dir(self.iteration_dir, tp_rank, pp_rank, self.pp_size), f"{kind}.safetensors"
        )

    def _handle(self, path: str) -> Any:
        if path not in self._handles:
            self._handles[path] = _open_tensors(path)
        return self._handles[path]

    def _read(self, path: str, name: str) -> torch.Tensor:
        try:
            return self._handle(path).get_tensor(name)
        except SafetensorError as error:
            raise CheckpointError(
                f"checkpoint file {path} holds no tensor {name!r} ({error}); the files of "
                f"{self.iteration_dir} do not belong together: load another iteration"
            ) from error

    def _record(self, param: str) -> dict[str, Any]:
        if param not in self.params:
            raise CheckpointError(
                f"{self.iteration_dir} holds no weight {param!r} (it holds {list(self.params)[:5]}...); the "
                "checkpoint was saved from a different model"
            )
        return self.params[param]

    def sharding(self, name: str, kind: str = "model") -> TensorSharding:
        """How a tensor (optimizer tensors: `<param>.<state>`, split like their param) is cut across TP."""
        record = self._record(_param_of(name, kind))
        return TensorSharding(record["partition_dim"], record["partition_stride"])

    def _repads(self, name: str, kind: str, padded_vocab_size: int) -> bool:
        param = _param_of(name, kind)
        return param in VOCAB_PARAMS and self._record(param)["global_shape"][0] != padded_vocab_size

    def global_tensor(
        self, name: str, kind: str = "model", padded_vocab_size: int | None = None
    ) -> torch.Tensor:
        """A whole tensor, its TP shards merged; given `padded_vocab_size`, its vocabulary padding re-cut."""
        sharding = self.sharding(name, kind)
        pp_rank = self._record(_param_of(name, kind))["pp_rank"]
        tp_ranks = range(self.tp_size) if sharding.is_split else [0]
        tensor = merge_tp_shards([self._read(self.path(kind, r, pp_rank), name) for r in tp_ranks], sharding)
        if padded_vocab_size is not None and self._repads(name, kind, padded_vocab_size):
            # weights and fp32 main params copy the last row, Adam moments start at zero
            tensor = resize_vocab(tensor, padded_vocab_size, kind == "model" or name.endswith(".main_param"))
        return tensor

    def tensor_for(
        self, name: str, kind: str, tp_size: int, tp_rank: int, padded_vocab_size: int
    ) -> torch.Tensor:
        """TP rank `tp_rank`'s slice (of `tp_size`) of a tensor, the vocabulary padded to `padded_vocab_size`."""
        sharding = self.sharding(name, kind)
        if sharding.is_split and tp_size == self.tp_size and not self._repads(name, kind, padded_vocab_size):
            pp_rank = self._record(_param_of(name, kind))["pp_rank"]
            return self._read(self.path(kind, tp_rank, pp_rank), name)  # the saved cut: one shard
        return split_tp_shard(
            self.global_tensor(name, kind, padded_vocab_size), sharding, tp_size, tp_rank, name
        )

    def optimizer_json_paths(self) -> list[str]:
        return [
            os.path.join(model_shard_dir(self.iteration_dir, 0, pp_rank, self.pp_size), "optimizer.json")
            for pp_rank in range(self.pp_size)
        ]

    def has_optimizer_state(self) -> bool:
        return all(os.path.exists(path) for path in self.optimizer_json_paths())

    def _optimizer_meta(self) -> tuple[dict, set[str]]:
        """Every stage's optimizer.json merged (per-param entries are keyed by checkpoint name), and the
        names of the optimizer tensors saved."""
        if self._saved_optimizer is None:
            stages = [_read_json(path) for path in self.optimizer_json_paths()]
            meta = {**stages[0], "param_names": [], "scalars": {}, "tensor_states": {}}
            tensor_names: set[str] = set()
            for pp_rank, stage in enumerate(stages):
                meta["param_names"] += stage["param_names"]
                meta["scalars"].update(stage["scalars"])
                meta["tensor_states"].update(stage["tensor_states"])
                path = self.path("optimizer", 0, pp_rank)
                if os.path.exists(path):
                    tensor_names.update(self._handle(path).keys())
            self._saved_optimizer = meta, tensor_names
        return self._saved_optimizer

    def optimizer_tensor_names(self, names: dict[str, str]) -> dict[str, str]:
        """{`<key>.<state>`: `<checkpoint name>.<state>`} for every optimizer tensor saved for the params
        `names` (key -> checkpoint name)."""
        saved, tensor_names = self._optimizer_meta()
        return {
            f"{key}.{state_name}": f"{name}.{state_name}"
            for key, name in names.items()
            for state_name in [*saved["tensor_states"].get(name, []), "main_param"]
            if f"{name}.{state_name}" in tensor_names
        }

    def optimizer_meta_for(self, names: dict[str, str]) -> dict:
        """The JSON part of the optimizer's `state_dict()` for the params `names`, keyed by `key`."""
        saved, _ = self._optimizer_meta()
        return {
            **saved,
            "param_names": list(names),
            "scalars": {
                key: saved["scalars"][name] for key, name in names.items() if name in saved["scalars"]
            },
            "tensor_states": {
                key: saved["tensor_states"][name]
                for key, name in names.items()
                if name in saved["tensor_states"]
            },
        }


def _param_of(name: str, kind: str) -> str:
    """The param an optimizer tensor `<param>.<state>` belongs to (a model tensor is its own)."""
    return name if kind == "model" else name.rsplit(".", 1)[0]


def check_compatible(metadata: dict, config: MegatronConfig, padded_vocab_size: int, where: str) -> None:
    """Refuse a checkpoint whose weights cannot fit this run's model, naming the first setting that differs.

    The parallel layout may differ; the padded vocabulary may differ only as TP sizes pad one true
    vocabulary differently (Megatron pads to a multiple of --make-vocab-size-divisible-by x TP).
    """
    saved_model = metadata["args"]["model"]
    for name in MODEL_ARGS_TO_CHECK:
        ours = getattr(config.model, name)
        if name in saved_model and saved_model[name] != ours:
            raise CheckpointError(
                f"checkpoint {where} was saved with {name}={saved_model[name]} but this run has {name}={ours}; "
                f"pass --{name.replace('_', '-')} {saved_model[name]} or load a matching checkpoint"
            )
    our_multiple = (
        config.tokenizer.make_vocab_size_divisible_by * state.get_tensor_model_parallel_world_size()
    )
    saved_vocab = metadata["padded_vocab_size"]
    if not padded_vocab_sizes_agree(
        saved_true_vocab_range(metadata), true_vocab_range(padded_vocab_size, our_multiple)
    ):
        raise CheckpointError(
            f"checkpoint {where} was saved with padded_vocab_size={saved_vocab} but this run has "
            f"padded_vocab_size={padded_vocab_size}, more than TP padding explains: use the checkpoint's "
            "tokenizer (and --make-vocab-size-divisible-by)"
        )


def _load_model_weights(
    model: torch.nn.Module,
    saved: SavedCheckpoint,
    names: dict[str, str],
    padded_vocab_size: int,
    tp_size: int,
    tp_rank: int,
) -> None:
    weights = {
        local: saved.tensor_for(name, "model", tp_size, tp_rank, padded_vocab_size)
        for local, name in names.items()
    }
    for local, tensor in model.state_dict().items():
        if weights[local].shape != tensor.shape:
            raise CheckpointError(
                f"{saved.iteration_dir}: weight {names[local]!r} has shape {tuple(weights[local].shape)} for "
                f"TP rank {tp_rank} of {tp_size} but the model's is {tuple(tensor.shape)}"
            )
    model.load_state_dict(weights)


def load_checkpoint(
    model: StageModel,
    optimizer: Any | None,
    opt_param_scheduler: Any | None,
    config: MegatronConfig,
    padded_vocab_size: int,
) -> TrainingProgress:
    """Load `--load` (its latest iteration, or `--ckpt-step`) with Megatron's --finetune / --no-load-* rules,
    resharding weights and optimizer state when it was saved under another (TP, PP, DP, virtual) layout.

    `model` is what `save_checkpoint` takes: this stage's module, or the list of its chunks when interleaved.

    Without a latest marker the run starts from scratch (Megatron's behaviour), unless
    --exit-on-missing-checkpoint asks for an error.
    """
    ckpt = config.checkpoint
    iteration_dir = resolve_iteration_dir(ckpt.load, ckpt.ckpt_step)
    if iteration_dir is None:
        message = f"no {TRACKER_FILENAME} in {ckpt.load}: nothing to load"
        if ckpt.exit_on_missing_checkpoint:
            raise CheckpointError(message + " (and --exit-on-missing-checkpoint is set)")
        logger.warning("%s; starting from random weights", message)
        return TrainingProgress()
    saved = SavedCheckpoint(iteration_dir)
    metadata = saved.metadata
    check_compatible(metadata, config, padded_vocab_size, iteration_dir)
    tp_size, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    saved_layout = (saved.tp_size, saved.pp_size)
    our_layout = (tp_size, state.get_pipeline_model_parallel_world_size())
    if saved_layout != our_layout and _rank() == 0:
        logger.info("resharding %s from (TP, PP) = %s to %s", iteration_dir, saved_layout, our_layout)
    names = _global_names(model, config)
    model = _stage_module(model)
    _load_model_weights(model, saved, names, padded_vocab_size, tp_size, tp_rank)
    if ckpt.finetune:
        if optimizer is not None:
            optimizer.reload_model_params()
        logger.info("loaded weights of %s for finetuning (iteration and samples reset)", iteration_dir)
        return TrainingProgress()
    if optimizer is not None and not ckpt.no_load_optim:
        if not saved.has_optimizer_state():
            missing = next(p for p in saved.optimizer_json_paths() if not os.path.exists(p))
            raise CheckpointError(
                f"{missing} is missing (saved with --no-save-optim?); pass --no-load-optim to load the "
                "weights with a fresh optimizer"
            )
        trained = {n: names[n] for n, p in model.named_parameters() if p.requires_grad}
        tensors = {
            key: saved.tensor_for(name, "optimizer", tp_size, tp_rank, padded_vocab_size)
            for key, name in saved.optimizer_tensor_names(trained).items()
        }
        meta = saved.optimizer_meta_for(trained)
        optimizer.load_state_dict(tensors, meta, source=saved.optimizer_json_paths()[0])
        if opt_param_scheduler is not None and metadata["opt_param_scheduler"] is not None:
            opt_param_scheduler.load_state_dict(metadata["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()
    if not ckpt.no_load_rng:
        _load_rng_state(iteration_dir, metadata, saved_layout, our_layout)
    logger.info("loaded checkpoint %s", iteration_dir)
    return TrainingProgress(
        iteration=metadata["iteration"],
        consumed_train_samples=metadata["consumed_train_samples"],
        consumed_valid_samples=metadata["consumed_valid_samples"],
    )


def _load_rng_state(
    iteration_dir: str, metadata: dict, saved_layout: tuple[int, int], our_layout: tuple[int, int]
) -> None:
    """This rank's RNG states; skipped (as --no-load-rng) when (TP, PP) changed, as Megatron does: another
    layout's per-rank streams mean nothing here."""
    if saved_layout != our_layout:
        if _rank() == 0:
            logger.warning(
                "(TP, PP) changed from %s to %s: RNG states are per rank and do not carry over, so they are "
                "not loaded (as --no-load-rng); dropout continues from this run's --seed",
                saved_layout,
                our_layout,
            )
        return
    prefix = os.path.join(iteration_dir, "rng", f"rank_{_rank():05d}")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if metadata["world_size"] != world_size or not os.path.exists(prefix + ".safetensors"):
        raise CheckpointError(
            f"{iteration_dir} holds no RNG state for rank {_rank()} of {world_size} (saved by "
            f"{metadata['world_size']} ranks, or with --no-save-rng); pass --no-load-rng to continue "
            "with fresh RNG states"
        )
    _set_rng_state(_load_tensors(prefix + ".safetensors"), _read_json(prefix + ".json"))


def load_model_for_inference(
    load_dir: str, iteration: int | None = None, device: torch.device | str | None = None
) -> tuple[torch.nn.Module, MegatronConfig]:
    """A GPTModel in eval mode with the checkpoint's weights, and the config it was trained with.

    Single process: the TP shards and PP stages of any saved layout are merged into one model.
    """
    from megatron_train.device import get_device
    from megatron_train.models.gpt import GPTModel

    iteration_dir = resolve_iteration_dir(load_dir, iteration)
    if iteration_dir is None:
        raise CheckpointError(
            f"no {TRACKER_FILENAME} in {load_dir}: pass iteration= or a directory with a save"
        )
    saved = SavedCheckpoint(iteration_dir)
    config = config_from_dict(saved.metadata["args"])
    config.parallel.tensor_model_parallel_size = 1
    config.parallel.pipeline_model_parallel_size = 1
    config.parallel.sequence_parallel = False
    model = GPTModel(config.model, saved.padded_vocab_size)
    names = {name: name for name in model.state_dict()}
    _load_model_weights(model, saved, names, saved.padded_vocab_size, tp_size=1, tp_rank=0)
    model.to(device=device or get_device(), dtype=config.model.params_dtype)
    model.eval()
    return model, config
