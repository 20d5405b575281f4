"""The `flow` loader and saver: Megatron-Flow's own checkpoints (`megatron_train.checkpointing`).

Flow to flow keeps the optimizer state and is `tools/checkpoint_util.convert_checkpoint`'s resharding; these
two carry the weights only, to and from the other formats (docs/architecture.md, checkpoints). The saver writes
a complete run directory (iteration `weights.iteration`, no optimizer, scheduler or RNG state) for a target
(TP, PP): load it with `--finetune` (or `--no-load-optim --no-load-rng`).
"""

from __future__ import annotations

import os

from megatron_train.arguments import SECTIONS, MegatronConfig, config_from_dict, config_to_dict
from megatron_train.checkpointing import (
    FORMAT_VERSION,
    METADATA_FILENAME,
    CheckpointError,
    SavedCheckpoint,
    checkpoint_dir,
    model_shard_dir,
    require_iteration_dir,
    sharding_record,
    write_metadata_and_marker,
    write_shard,
)
from megatron_train.checkpointing.layout import (
    ExpertLayout,
    split_expert_tensor,
    split_tp_shard,
    stage_tensor_names,
)
from megatron_train.checkpointing.saved import saved_true_vocab_range
from megatron_train.convert.checks import check_fields, check_layers, check_shapes
from megatron_train.convert.target import output_folder
from megatron_train.convert.tokenizer_files import copy_tokenizer, tokenizer_sources
from megatron_train.convert.weights import (
    ModelWeights,
    expert_names,
    model_shapes,
    model_shardings,
    pad_vocab,
    padded_size_of,
    padded_vocab_for_layout,
    trim_vocab,
)
from megatron_train.families.family import ModelFamily
from megatron_train.families.registry import checkpoint_family, checkpoint_record
from megatron_train.models.config import TransformerConfig
from megatron_train.training.config import TokenizerConfig


def load(
    load_dir: str,
    iteration: int | None = None,
    true_vocab_size: int | None = None,
    model_family: str | None = None,
) -> ModelWeights:
    """The weights of `load_dir`'s checkpoint (latest, or `iteration`), whatever (TP, PP) wrote it; the
    saved args are checked against the saved tensors before any is read. A family from outside the project
    needs `model_family` (--model-family) to name it."""
    iteration_dir = require_iteration_dir(load_dir, iteration)
    saved = SavedCheckpoint(iteration_dir)
    family = checkpoint_family(saved.metadata, model_family, iteration_dir)
    config = checked_saved_config(saved, iteration_dir, family)
    low, high = saved_true_vocab_range(saved.metadata)
    recorded = config.model.true_vocab_size
    if recorded is not None and not low < recorded <= high:
        raise CheckpointError(
            f"{iteration_dir}/{METADATA_FILENAME}: args.model.true_vocab_size is {recorded}, but the checkpoint's "
            f"padded vocabulary holds a tokenizer of {low + 1} to {high} tokens; the args are not its own"
        )
    true_vocab_size = true_vocab_size or recorded
    if true_vocab_size is None:
        if high - low != 1:
            raise ValueError(
                f"{iteration_dir} does not record its tokenizer's vocabulary size (between {low + 1} and "
                f"{high}): pass --true-vocab-size"
            )
        true_vocab_size = high
    if true_vocab_size > saved.padded_vocab_size:
        raise ValueError(
            f"{iteration_dir}: a vocabulary of {true_vocab_size} tokens exceeds the checkpoint's "
            f"{saved.padded_vocab_size} rows; pass the size of the tokenizer it was trained with"
        )
    config.model.true_vocab_size = true_vocab_size
    tensors = {name: saved.global_tensor(name) for name in saved.params}
    return ModelWeights(
        config,
        trim_vocab(tensors, true_vocab_size),
        tokenizer_sources(config.tokenizer, load_dir),
        saved.metadata["iteration"],
        saved.metadata.get("token_ids", {}),
        family,
    )


def checked_saved_config(saved: SavedCheckpoint, where: str, family: ModelFamily) -> MegatronConfig:
    """The config metadata.json's args record, its model and tokenizer settings checked (types, sizes) and
    compared with the saved tensors (layer count, then every shape against the model of `family` it describes)
    before the model is built on the meta device or a tensor read."""
    source = os.path.join(where, METADATA_FILENAME)
    args = saved.metadata.get("args")
    if not isinstance(args, dict) or not all(isinstance(args.get(name, {}), dict) for name in SECTIONS):
        raise CheckpointError(f"{source}: args is not an object of config sections")
    check_fields(args.get("model", {}), TransformerConfig, f"{source} (args.model)")
    check_fields(args.get("tokenizer", {}), TokenizerConfig, f"{source} (args.tokenizer)")
    try:
        config = config_from_dict(args)
    except (ValueError, TypeError) as error:  # the config's own rules (they name flags), a missing size
        raise CheckpointError(f"{source} (args): {error}") from error
    records = {name: tuple(record["global_shape"]) for name, record in saved.params.items()}
    stacks = family.pipeline.layer_stacks
    if stacks:  # the first stack holds --num-layers layers
        check_layers(
            config.model.num_layers,
            records,
            f"{stacks[0]}.layers.",
            "args.model.num_layers",
            source,
            "its shard files",
        )
    model = config.model
    expected = model_shapes(config, saved.padded_vocab_size, family, source)
    sizes = f"num_layers {model.num_layers}, hidden_size {model.hidden_size}, ffn_hidden_size {model.ffn_hidden_size}"
    check_shapes(records, expected, sizes, source, f"the shard files of {where}")
    return config


def save(
    weights: ModelWeights, save_dir: str, target_tp: int = 1, target_pp: int = 1, overwrite: bool = False
) -> str:
    """Write `weights` as a checkpoint split for (target_tp, target_pp), built beside `save_dir` and moved into
    place whole (`convert.target`); returns the iteration folder.

    Tokenizer files go to `<save_dir>/tokenizer/`, which the saved args name (`convert.tokenizer_files`)."""
    config = weights.config
    padded_vocab_size = padded_vocab_for_layout(weights, target_tp, target_pp)
    config.parallel.tensor_model_parallel_size = target_tp
    config.parallel.pipeline_model_parallel_size = target_pp
    config.parallel.num_layers_per_virtual_pipeline_stage = None
    with output_folder(save_dir, overwrite, padded_size_of(weights, padded_vocab_size)) as out:
        config.tokenizer = copy_tokenizer(config.tokenizer, weights.tokenizer_files, out, save_dir)
        _write(weights, out, target_tp, target_pp, padded_vocab_size)
    return checkpoint_dir(save_dir, weights.iteration)


def _write(weights: ModelWeights, root: str, target_tp: int, target_pp: int, padded_vocab_size: int) -> None:
    """The shard files, then metadata.json and the latest marker, into the folder `root`."""
    config, out_dir = weights.config, checkpoint_dir(root, weights.iteration)
    tensors = pad_vocab(weights.tensors, padded_vocab_size)
    shardings = model_shardings(config, padded_vocab_size, weights.family)
    experts = expert_names(config, padded_vocab_size, weights.family)
    split = weights.family.pipeline
    files = {}
    for pp_rank in range(target_pp):
        layers = split.layer_range(config.model, pp_rank, target_pp)
        stage = stage_tensor_names(split, list(shardings), layers, pp_rank == 0, pp_rank == target_pp - 1)
        names = [name for name in stage if name not in experts]
        moe = [name for name in stage if name in experts]
        for etp_rank in range(target_tp) if moe else ():  # MoE experts as a run splits them: EP 1, ETP = TP
            layout = ExpertLayout(1, 0, target_tp, etp_rank)
            shard = {name: split_expert_tensor(tensors[name], shardings[name], layout, name) for name in moe}
            records = {
                name: sharding_record(
                    list(tensors[name].shape), shardings[name], False, etp_rank, target_tp, pp_rank, target_pp,
                    name, layout,
                )
                for name in moe
            }  # fmt: skip
            shard_dir = model_shard_dir(out_dir, etp_rank, pp_rank, target_pp, layout.ep_rank)
            files.update(write_shard(shard_dir, shard, records, None))
        for tp_rank in range(target_tp):
            shard = {
                name: split_tp_shard(tensors[name], shardings[name], target_tp, tp_rank, name)
                for name in names
            }
            records = {
                name: sharding_record(
                    list(tensors[name].shape),
                    shardings[name],
                    False,
                    tp_rank,
                    target_tp,
                    pp_rank,
                    target_pp,
                    name,
                )
                for name in names
            }
            files.update(
                write_shard(model_shard_dir(out_dir, tp_rank, pp_rank, target_pp), shard, records, None)
            )
    metadata = {
        "format_version": FORMAT_VERSION,
        "iteration": weights.iteration,
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
        "padded_vocab_size": padded_vocab_size,
        "true_vocab_size_range": (weights.true_vocab_size - 1, weights.true_vocab_size),
        "world_size": target_tp * target_pp,
        "tensor_model_parallel_size": target_tp,
        "pipeline_model_parallel_size": target_pp,
        "virtual_pipeline_model_parallel_size": None,
        "data_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": target_tp,
        "opt_param_scheduler": None,
        "args": config_to_dict(config),
        "token_ids": weights.token_ids,
        **checkpoint_record(weights.family.name, config.model.model_family),
    }
    write_metadata_and_marker(root, weights.iteration, metadata, files)
