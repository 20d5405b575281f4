"""Save and load training checkpoints: safetensors for tensors, JSON for everything else, no pickles.

Layout of a run directory (Megatron's names where Megatron has them):

    <save>/latest_checkpointed_iteration.txt     written atomically, only after the folder is complete
    <save>/iter_0000100/metadata.json            iteration, consumed samples, args, layout, scheduler (last)
    <save>/iter_0000100/mp_rank_00/model.safetensors       this TP rank's shard of the weights
    <save>/iter_0000100/mp_rank_00/optimizer.safetensors   fp32 main params and Adam moments (DP rank 0)
    <save>/iter_0000100/mp_rank_00/optimizer.json          step counts, param groups, loss scaler
    <save>/iter_0000100/rng/rank_00000.safetensors / .json every rank's python, numpy, torch, CUDA and
                                                           model-parallel-tracker RNG states

Each param's sharding is recorded in the safetensors metadata ("sharding": global shape, whether and along
which dim it is split over TP, TP/PP rank and size), so a later tool can reshard across (TP, PP, DP) layouts;
optimizer tensors are named `<param name>.<state>` (main_param, exp_avg, exp_avg_sq) and shard like their
param. Loading needs the same TP/PP sizes (any DP size works except for RNG states: use --no-load-rng).
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from megatron_train.arguments import MegatronConfig, config_from_dict, config_to_dict
from megatron_train.parallel import state
from megatron_train.parallel.random import get_rng_tracker

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
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


def _load_tensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file, turning a missing or damaged file into an actionable CheckpointError."""
    if not os.path.exists(path):
        raise CheckpointError(
            f"checkpoint file {path} is missing: the save did not finish or files were moved"
        )
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
        return load_file(path), metadata
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint file {path} is corrupt ({error}); load an earlier iteration with --ckpt-step "
            "or delete this iteration folder"
        ) from error


def _read_json(path: str) -> Any:
    if not os.path.exists(path):
        raise CheckpointError(
            f"checkpoint file {path} is missing: the save did not finish or files were moved"
        )
    try:
        with open(path) as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON ({error})") from error


def _unique_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tied copies (e.g. the output layer sharing the word embedding): safetensors refuses aliases."""
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[tuple[int, tuple[int, ...]], str] = {}
    for name, tensor in tensors.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if tensor.numel() and key in first_name:
            aliases[name] = first_name[key]
        else:
            first_name[key] = name
            unique[name] = tensor
    return unique, aliases


def _sharding_info(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Per param: global shape and how it is split across TP (Megatron's param attributes) and PP."""
    tp_size = state.get_tensor_model_parallel_world_size()
    info = {}
    for name, param in model.named_parameters():
        split = bool(getattr(param, "tensor_model_parallel", False))
        dim = int(getattr(param, "partition_dim", -1)) if split else -1
        global_shape = list(param.shape)
        if split:
            global_shape[dim] *= tp_size
        info[name] = {
            "global_shape": global_shape,
            "tensor_model_parallel": split,
            "partition_dim": dim,
            "partition_stride": int(getattr(param, "partition_stride", 1)),
            "sequence_parallel": bool(getattr(param, "sequence_parallel", False)),
            "tp_rank": state.get_tensor_model_parallel_rank(),
            "tp_size": tp_size,
            "pp_rank": state.get_pipeline_model_parallel_rank(),
            "pp_size": state.get_pipeline_model_parallel_world_size(),
        }
    return info


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
    model: torch.nn.Module,
    optimizer: Any | None,
    opt_param_scheduler: Any | None,
    loaded: TrainingProgress,
    config: MegatronConfig,
    padded_vocab_size: int,
) -> str:
    """Every rank writes its part; rank 0 writes metadata.json and then the latest marker. Returns the folder.

    `model` is the unwrapped module; `loaded` carries the consumed sample counts to store.
    """
    root = config.checkpoint.save
    iteration_dir = checkpoint_dir(root, iteration)
    shard_dir = _this_shard_dir(iteration_dir)
    os.makedirs(shard_dir, exist_ok=True)
    os.makedirs(os.path.join(iteration_dir, "rng"), exist_ok=True)
    dp_rank = state.get_data_parallel_rank()
    if dp_rank == 0:
        weights, aliases = _unique_tensors(model.state_dict())
        metadata = {
            "format_version": str(FORMAT_VERSION),
            "sharding": json.dumps(_sharding_info(model)),
            "aliases": json.dumps(aliases),
        }
        _atomic_save_tensors(weights, os.path.join(shard_dir, "model.safetensors"), metadata)
        if optimizer is not None and not config.checkpoint.no_save_optim:
            tensors, meta = optimizer.state_dict()
            if tensors:  # safetensors cannot read back an empty file (an optimizer that never stepped)
                _atomic_save_tensors(tensors, os.path.join(shard_dir, "optimizer.safetensors"), metadata)
            _atomic_write_text(os.path.join(shard_dir, "optimizer.json"), json.dumps(meta))
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
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "tensor_model_parallel_size": state.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": state.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": state.get_data_parallel_world_size(),
            "opt_param_scheduler": opt_param_scheduler.state_dict()
            if opt_param_scheduler is not None
            else None,
            "args": config_to_dict(config),
        }
        _atomic_write_text(os.path.join(iteration_dir, METADATA_FILENAME), json.dumps(metadata, indent=1))
        _atomic_write_text(os.path.join(root, TRACKER_FILENAME), str(iteration))
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


def _resolve_iteration_dir(load_dir: str, iteration: int | None) -> str | None:
    if iteration is None:
        iteration = read_latest_iteration(load_dir)
        if iteration is None:
            return None
    iteration_dir = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(iteration_dir):
        raise CheckpointError(
            f"checkpoint folder {iteration_dir} does not exist (iterations there: "
            f"{sorted(d for d in os.listdir(load_dir) if d.startswith('iter_'))})"
        )
    return iteration_dir


def read_metadata(iteration_dir: str) -> dict:
    metadata = _read_json(os.path.join(iteration_dir, METADATA_FILENAME))
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{iteration_dir}/{METADATA_FILENAME}: format version {metadata.get('format_version')} is not "
            f"{FORMAT_VERSION}, the one this code reads"
        )
    return metadata


def check_compatible(metadata: dict, config: MegatronConfig, padded_vocab_size: int, where: str) -> None:
    """Refuse a checkpoint whose weights cannot fit this run's model, naming the first setting that differs."""
    saved_model = metadata["args"]["model"]
    for name in MODEL_ARGS_TO_CHECK:
        ours = getattr(config.model, name)
        if name in saved_model and saved_model[name] != ours:
            raise CheckpointError(
                f"checkpoint {where} was saved with {name}={saved_model[name]} but this run has {name}={ours}; "
                f"pass --{name.replace('_', '-')} {saved_model[name]} or load a matching checkpoint"
            )
    ours_layout = {
        "padded_vocab_size": padded_vocab_size,
        "tensor_model_parallel_size": state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": state.get_pipeline_model_parallel_world_size(),
    }
    for name, ours in ours_layout.items():
        if metadata[name] != ours:
            raise CheckpointError(
                f"checkpoint {where} was saved with {name}={metadata[name]} but this run has {name}={ours}; "
                "resharding across layouts is not supported yet: use the saved layout and tokenizer settings"
            )


def _load_model_weights(model: torch.nn.Module, path: str) -> None:
    tensors, metadata = _load_tensors(path)
    for alias, original in json.loads(metadata.get("aliases", "{}")).items():
        tensors[alias] = tensors[original]
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing weights {missing[:5]}, unexpected weights {unexpected[:5]}")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{path}: weight {name!r} has shape {tuple(tensor.shape)} but the model's is "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(tensors)


def load_checkpoint(
    model: torch.nn.Module,
    optimizer: Any | None,
    opt_param_scheduler: Any | None,
    config: MegatronConfig,
    padded_vocab_size: int,
) -> TrainingProgress:
    """Load `--load` (its latest iteration, or `--ckpt-step`) with Megatron's --finetune / --no-load-* rules.

    Without a latest marker the run starts from scratch (Megatron's behaviour), unless
    --exit-on-missing-checkpoint asks for an error.
    """
    ckpt = config.checkpoint
    iteration_dir = _resolve_iteration_dir(ckpt.load, ckpt.ckpt_step)
    if iteration_dir is None:
        message = f"no {TRACKER_FILENAME} in {ckpt.load}: nothing to load"
        if ckpt.exit_on_missing_checkpoint:
            raise CheckpointError(message + " (and --exit-on-missing-checkpoint is set)")
        logger.warning("%s; starting from random weights", message)
        return TrainingProgress()
    metadata = read_metadata(iteration_dir)
    check_compatible(metadata, config, padded_vocab_size, iteration_dir)
    shard_dir = _this_shard_dir(iteration_dir)
    _load_model_weights(model, os.path.join(shard_dir, "model.safetensors"))
    if ckpt.finetune:
        if optimizer is not None:
            optimizer.reload_model_params()
        logger.info("loaded weights of %s for finetuning (iteration and samples reset)", iteration_dir)
        return TrainingProgress()
    if optimizer is not None and not ckpt.no_load_optim:
        meta_path = os.path.join(shard_dir, "optimizer.json")
        if not os.path.exists(meta_path):
            raise CheckpointError(
                f"{meta_path} is missing (saved with --no-save-optim?); pass --no-load-optim to load the "
                "weights with a fresh optimizer"
            )
        meta = _read_json(meta_path)
        tensors = {}
        if meta["tensor_states"] or optimizer.mixed_precision:
            tensors, _ = _load_tensors(os.path.join(shard_dir, "optimizer.safetensors"))
        optimizer.load_state_dict(tensors, meta, source=meta_path)
        if opt_param_scheduler is not None and metadata["opt_param_scheduler"] is not None:
            opt_param_scheduler.load_state_dict(metadata["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()
    if not ckpt.no_load_rng:
        prefix = os.path.join(iteration_dir, "rng", f"rank_{_rank():05d}")
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        if metadata["world_size"] != world_size or not os.path.exists(prefix + ".safetensors"):
            raise CheckpointError(
                f"{iteration_dir} holds no RNG state for rank {_rank()} of {world_size} (saved by "
                f"{metadata['world_size']} ranks, or with --no-save-rng); pass --no-load-rng to continue "
                "with fresh RNG states"
            )
        tensors, _ = _load_tensors(prefix + ".safetensors")
        _set_rng_state(tensors, _read_json(prefix + ".json"))
    logger.info("loaded checkpoint %s", iteration_dir)
    return TrainingProgress(
        iteration=metadata["iteration"],
        consumed_train_samples=metadata["consumed_train_samples"],
        consumed_valid_samples=metadata["consumed_valid_samples"],
    )


def load_model_for_inference(
    load_dir: str, iteration: int | None = None, device: torch.device | str | None = None
) -> tuple[torch.nn.Module, MegatronConfig]:
    """A GPTModel in eval mode with the checkpoint's weights, and the config it was trained with.

    Single process: a checkpoint saved with TP > 1 is merged along each param's partition dim.
    """
    from megatron_train.device import get_device
    from megatron_train.models.gpt import GPTModel

    iteration_dir = _resolve_iteration_dir(load_dir, iteration)
    if iteration_dir is None:
        raise CheckpointError(
            f"no {TRACKER_FILENAME} in {load_dir}: pass iteration= or a directory with a save"
        )
    metadata = read_metadata(iteration_dir)
    config = config_from_dict(metadata["args"])
    if metadata["pipeline_model_parallel_size"] != 1:
        raise CheckpointError(f"{iteration_dir}: merging pipeline-parallel checkpoints is not supported yet")
    tp_size = metadata["tensor_model_parallel_size"]
    config.parallel.tensor_model_parallel_size = 1
    config.parallel.sequence_parallel = False
    model = GPTModel(config.model, metadata["padded_vocab_size"])
    shards = [
        _load_tensors(os.path.join(model_shard_dir(iteration_dir, r, 0, 1), "model.safetensors"))
        for r in range(tp_size)
    ]
    weights = _merge_tp_shards(shards)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(f"{iteration_dir}: weights missing for {missing[:5]}")
    model.load_state_dict({k: v for k, v in weights.items() if k in expected})
    dtype = (
        torch.bfloat16 if config.training.bf16 else torch.float16 if config.training.fp16 else torch.float32
    )
    model.to(device=device or get_device(), dtype=dtype)
    model.eval()
    return model, config


def _merge_tp_shards(shards: list[tuple[dict[str, torch.Tensor], dict[str, str]]]) -> dict[str, torch.Tensor]:
    """Concatenate TP shards along their partition dim (strided params interleave their stride blocks)."""
    first_tensors, first_meta = shards[0]
    sharding = json.loads(first_meta.get("sharding", "{}"))
    merged = {}
    for name, tensor in first_tensors.items():
        info = sharding.get(name)
        if len(shards) == 1 or info is None or not info["tensor_model_parallel"]:
            merged[name] = tensor
            continue
        dim, stride = info["partition_dim"], info["partition_stride"]
        parts = [s[0][name].chunk(stride, dim=dim) for s in shards]
        merged[name] = torch.cat([p[i] for i in range(stride) for p in parts], dim=dim)
    for alias, original in json.loads(first_meta.get("aliases", "{}")).items():
        merged[alias] = merged[original]
    return merged
