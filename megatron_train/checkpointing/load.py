"""Load a training checkpoint into this rank's stage, with Megatron's --finetune / --no-load-* rules.

A checkpoint saved under any (TP, PP, DP, virtual) layout loads under any other (`saved.SavedCheckpoint`
reshards); `check_compatible` first refuses one whose model settings differ. A --load folder that holds
complete iterations but no latest marker is an error rather than a silent fresh start that would overwrite
them (docs/architecture.md, checkpoints).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing.dist_checkpoint import is_dist_checkpoint, load_dist_checkpoint
from megatron_train.checkpointing.files import (
    NON_PERSISTENT_DIR,
    TRACKER_FILENAME,
    CheckpointError,
    CheckpointFiles,
    complete_iterations,
    read_latest_iteration,
    read_metadata,
    resolve_iteration_dir,
)
from megatron_train.checkpointing.layout import (
    ExpertLayout,
    TensorSharding,
    padded_vocab_sizes_agree,
    split_expert_tensor,
    true_vocab_range,
)
from megatron_train.checkpointing.names import (
    StageModel,
    current_expert_layout,
    global_names,
    model_type,
    stage_module,
)
from megatron_train.checkpointing.progress import TrainingProgress
from megatron_train.checkpointing.rng import global_rank, load_rng_state
from megatron_train.checkpointing.saved import SavedCheckpoint, saved_true_vocab_range
from megatron_train.families.registry import saved_family_name, trained_by
from megatron_train.models.moe.upcycling import dense_source, upcycle
from megatron_train.parallel import state

logger = logging.getLogger(__name__)

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
    "post_ln",
    "bert_binary_head",
    "swiglu",
    "add_bias_linear",
    "add_qkv_bias",
    "untie_embeddings_and_output_weights",
    "activation_func",
    "decoder_num_layers",
    "relative_attention_num_buckets",
    "mamba_state_dim",
    "mamba_head_dim",
    "mamba_num_groups",
    "mamba_num_heads",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_router_enable_expert_bias",
)

# Settings whose Megatron flag says the opposite of the field (the flag turns the default True off).
INVERTED_FLAGS = {"add_bias_linear": "--disable-bias-linear", "bert_binary_head": "--bert-no-binary-head"}


def flags_to_match(name: str, saved: object) -> str:
    """What to put on the command line for a model field to take the checkpoint's value `saved`."""
    if name in INVERTED_FLAGS:
        return f"{'drop' if saved else 'pass'} {INVERTED_FLAGS[name]}"
    flag = f"--{name.replace('_', '-')}"
    if saved is None or saved is False:  # the flag's absence gives it (a dense model has num_experts None)
        return f"drop {flag}"
    return f"pass {flag}" if saved is True else f"pass {flag} {saved}"


def check_compatible(metadata: dict, config: MegatronConfig, padded_vocab_size: int, where: str) -> None:
    """Refuse a checkpoint whose weights cannot fit this run's model, naming the first setting that differs.

    The parallel layout may differ; the padded vocabulary may differ only as TP sizes pad one true
    vocabulary differently (Megatron pads to a multiple of --make-vocab-size-divisible-by x TP). Upcycling
    (--moe-use-upcycling) takes a dense checkpoint whose MLP is the experts' size.
    """
    saved_model = metadata["args"]["model"]
    checked = MODEL_ARGS_TO_CHECK
    if config.model.moe_use_upcycling:
        if saved_model.get("num_experts") is not None:
            raise CheckpointError(
                f"checkpoint {where} already holds an MoE model: --moe-use-upcycling starts from a dense one; drop "
                "the flag to resume an MoE run"
            )
        if saved_model.get("ffn_hidden_size") != config.model.moe_ffn_hidden_size:
            raise CheckpointError(
                f"checkpoint {where} has --ffn-hidden-size {saved_model.get('ffn_hidden_size')}: upcycling copies its "
                f"MLP into every expert, so pass --moe-ffn-hidden-size {saved_model.get('ffn_hidden_size')}"
            )
        checked = tuple(name for name in MODEL_ARGS_TO_CHECK if not name.startswith(("num_experts", "moe_")))
    for name in checked:
        ours = getattr(config.model, name)
        if name in saved_model and saved_model[name] != ours:
            raise CheckpointError(
                f"checkpoint {where} was saved with {name}={saved_model[name]} but this run has {name}={ours}; "
                f"{flags_to_match(name, saved_model[name])} or load a matching checkpoint"
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


def load_model_weights(
    model: torch.nn.Module,
    saved: SavedCheckpoint,
    names: dict[str, str],
    padded_vocab_size: int,
    tp_size: int,
    tp_rank: int,
    experts: ExpertLayout | None = None,
) -> None:
    """`model`'s weights (`names`: its state-dict names -> checkpoint names) as TP rank `tp_rank` of `tp_size`, its
    MoE experts as `experts` says (default: all of them, unsplit)."""
    weights = {
        local: saved.tensor_for(name, "model", tp_size, tp_rank, padded_vocab_size, experts)
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
    saved: SavedCheckpoint | None = None,
) -> TrainingProgress:
    """Load `--load` (its latest iteration, or `--ckpt-step`) with Megatron's --finetune / --no-load-* rules,
    resharding weights and optimizer state when it was saved under another (TP, PP, DP, virtual) layout.
    `saved` is that checkpoint already opened in its own format (`convert.detect.open_checkpoint`: ours, or a
    Megatron-LM one converted in memory); without it `--load` is read as ours.

    `model` is what `save_checkpoint` takes: this stage's module, or the list of its chunks when interleaved.

    Without a latest marker the run starts from scratch (Megatron's behaviour) when nothing would be lost;
    see `_check_nothing_to_overwrite`.
    """
    ckpt = config.checkpoint
    if saved is None:
        iteration_dir = _iteration_dir_to_load(config)
    else:
        iteration_dir = saved.iteration_dir
    if config.model.moe_use_upcycling:
        _check_upcycling(config, iteration_dir)
    if iteration_dir is None:
        _check_nothing_to_overwrite(config)
        logger.warning(
            "no %s in %s: nothing to load; starting from random weights", TRACKER_FILENAME, ckpt.load
        )
        return TrainingProgress()
    if saved is None:
        metadata = read_metadata(iteration_dir)
        saved = None if is_dist_checkpoint(metadata) else SavedCheckpoint(iteration_dir)
    else:
        metadata = saved.metadata
    if saved is None and config.model.moe_use_upcycling:
        raise CheckpointError(
            f"{iteration_dir} is a torch_dist checkpoint: --moe-use-upcycling reads a dense checkpoint of ours; "
            f"convert it first (python -m megatron_train.tools.checkpoint_util --model-type GPT --loader torch_dist "
            f"--saver flow --load-dir {ckpt.load} --save-dir <dir>) and --load that"
        )
    if saved_family_name(metadata) != model_type(model):
        raise CheckpointError(
            f"checkpoint {iteration_dir} holds a {saved_family_name(metadata)} model but this run trains a "
            f"{model_type(model)} model: use {trained_by(metadata)} for it, or another --load"
        )
    check_compatible(metadata, config, padded_vocab_size, iteration_dir)
    saved_layout = (
        metadata["tensor_model_parallel_size"],
        metadata["pipeline_model_parallel_size"],
        metadata.get("context_parallel_size", 1),
    )
    our_layout = (
        state.get_tensor_model_parallel_world_size(),
        state.get_pipeline_model_parallel_world_size(),
        state.get_context_parallel_world_size(),
    )
    if saved_layout != our_layout and global_rank() == 0:
        logger.info("resharding %s from (TP, PP, CP) = %s to %s", iteration_dir, saved_layout, our_layout)
    if config.model.moe_use_upcycling:
        _load_upcycled_weights(model, saved, config, padded_vocab_size)
        if optimizer is not None:
            optimizer.reload_model_params()
        logger.info("upcycled the dense model of %s into %d experts per MoE layer", iteration_dir,
                    config.model.num_experts)  # fmt: skip
        return TrainingProgress()
    loads_optimizer = optimizer is not None and not ckpt.finetune and not ckpt.no_load_optim
    if saved is None:
        load_dist_checkpoint(iteration_dir, metadata, model, optimizer if loads_optimizer else None, config)
    else:
        _load_from_saved(saved, model, optimizer if loads_optimizer else None, config, padded_vocab_size)
    if optimizer is not None and not loads_optimizer:
        optimizer.reload_model_params()
    if ckpt.finetune:
        logger.info("loaded weights of %s for finetuning (iteration and samples reset)", iteration_dir)
        return TrainingProgress()
    if loads_optimizer and opt_param_scheduler is not None and metadata["opt_param_scheduler"] is not None:
        opt_param_scheduler.load_state_dict(metadata["opt_param_scheduler"])
    if not ckpt.no_load_rng:
        if saved is None:
            load_rng_state(CheckpointFiles(iteration_dir, metadata), metadata, saved_layout, our_layout)
        else:
            saved.restore_rng_state(our_layout)
    logger.info("loaded checkpoint %s", iteration_dir)
    return TrainingProgress(
        iteration=metadata["iteration"],
        consumed_train_samples=metadata["consumed_train_samples"],
        consumed_valid_samples=metadata["consumed_valid_samples"],
        loaded_from=iteration_dir,
    )


def _load_from_saved(
    saved: SavedCheckpoint,
    model: StageModel,
    optimizer: Any | None,
    config: MegatronConfig,
    padded_vocab_size: int,
) -> None:
    """The weights (and, given `optimizer`, its state) of one of our safetensors saves or a Megatron-LM checkpoint
    converted in memory, resharded to this rank."""
    tp_size, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    names = global_names(model, config)
    module = stage_module(model)
    experts = current_expert_layout()
    load_model_weights(module, saved, names, padded_vocab_size, tp_size, tp_rank, experts)
    if optimizer is None:
        return
    saved.require_optimizer_state()
    trained = {n: names[n] for n, p in module.named_parameters() if p.requires_grad}
    tensors = {
        key: saved.tensor_for(name, "optimizer", tp_size, tp_rank, padded_vocab_size, experts)
        for key, name in saved.optimizer_tensor_names(trained).items()
    }
    meta = saved.optimizer_meta_for(trained)
    optimizer.load_state_dict(tensors, meta, source=saved.optimizer_source)


def non_persistent_dir(config: MegatronConfig, root: str | None) -> str | None:
    """Where global non-persistent checkpoints of `root` (--save or --load) live: --non-persistent-global-ckpt-dir,
    else <root>/non_persistent (Megatron's); None without --non-persistent-ckpt-type global."""
    ckpt = config.checkpoint
    if ckpt.non_persistent_ckpt_type != "global":
        return None
    if ckpt.non_persistent_global_ckpt_dir is not None:
        return ckpt.non_persistent_global_ckpt_dir
    return None if root is None else os.path.join(root, NON_PERSISTENT_DIR)


def _iteration_dir_to_load(config: MegatronConfig) -> str | None:
    """--load's latest iteration (or --ckpt-step), or the newest non-persistent one when it is as new or newer
    (Megatron's rule)."""
    ckpt = config.checkpoint
    iteration_dir = resolve_iteration_dir(ckpt.load, ckpt.ckpt_step)
    transient = non_persistent_dir(config, ckpt.load)
    if ckpt.ckpt_step is not None or transient is None or read_latest_iteration(transient) is None:
        return iteration_dir
    newest = read_latest_iteration(transient)
    persistent = read_latest_iteration(ckpt.load) if iteration_dir is not None else None
    if persistent is None or newest >= persistent:
        logger.info("loading the non-persistent checkpoint of iteration %d from %s", newest, transient)
        return resolve_iteration_dir(transient, None)
    return iteration_dir


def _load_upcycled_weights(
    model: StageModel, saved: SavedCheckpoint, config: MegatronConfig, padded_vocab_size: int
) -> None:
    """A dense checkpoint's weights into an MoE model: each expert weight from its layer's dense MLP
    (`models.moe.upcycling`), cut for this rank's experts; the routers and shared experts keep their
    initialisation; the rest as `load_model_weights`."""
    tp_size, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    names = global_names(model, config)
    model = stage_module(model)
    experts = current_expert_layout()
    params = dict(model.named_parameters())
    weights = model.state_dict()
    for local, name in names.items():
        source = dense_source(name)
        if source is not None:
            dense = saved.global_tensor(source[0])
            everything = upcycle(dense, source[1], params[local].shape[0] * experts.ep_size)
            sharding = TensorSharding(params[local].partition_dim, params[local].partition_stride)
            weights[local] = split_expert_tensor(everything, sharding, experts, name)

        elif ".mlp.router." not in name and ".mlp.shared_experts." not in name:
            weights[local] = saved.tensor_for(name, "model", tp_size, tp_rank, padded_vocab_size)
    model.load_state_dict(weights)


def _check_upcycling(config: MegatronConfig, iteration_dir: str | None) -> None:
    """Megatron's rules: upcycling converts a dense checkpoint once, into a --save folder without checkpoints."""
    ckpt = config.checkpoint
    if iteration_dir is None:
        raise CheckpointError(
            f"--moe-use-upcycling needs the dense checkpoint to convert: --load {ckpt.load} has none"
        )
    saved = complete_iterations(ckpt.save)
    if saved:
        raise CheckpointError(
            f"--moe-use-upcycling converts the dense checkpoint of --load, but --save {ckpt.save} already holds "
            f"iterations {saved}: drop --moe-use-upcycling (and --load the MoE run) to resume it"
        )


def _check_nothing_to_overwrite(config: MegatronConfig) -> None:
    """Refuse a fresh start that would overwrite checkpoints: --load holds complete iterations but no latest
    marker (deleted, or lost in a copy), or --load holds nothing while --save holds another run's iterations
    (a mistyped --load). --exit-on-missing-checkpoint refuses any fresh start."""
    ckpt = config.checkpoint
    marker = os.path.join(ckpt.load, TRACKER_FILENAME)
    found = complete_iterations(ckpt.load)
    if found:
        raise CheckpointError(
            f"{ckpt.load} holds the checkpoints of iterations {found} but no {TRACKER_FILENAME}, and starting "
            f"from scratch would overwrite them: to resume, pass --ckpt-step {found[-1]} (or write {found[-1]} "
            f"into {marker}); to start a new run, pass an empty --load and --save folder"
        )
    if ckpt.exit_on_missing_checkpoint:
        raise CheckpointError(
            f"no {TRACKER_FILENAME} in {ckpt.load}: nothing to load (and --exit-on-missing-checkpoint is set)"
        )
    saved = complete_iterations(ckpt.save) if ckpt.save else []
    if saved:
        raise CheckpointError(
            f"--load {ckpt.load} holds no checkpoint but --save {ckpt.save} holds iterations {saved} of another "
            f"run, which this fresh start would overwrite: pass --load {ckpt.save} to resume them, or pass an "
            "empty --save folder"
        )
