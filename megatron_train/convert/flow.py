"""The `flow` loader and saver: Megatron-Flow's own checkpoints (`megatron_train.checkpointing`).

Flow to flow keeps the optimizer state and is `tools/checkpoint_util.convert_checkpoint`'s resharding; these
two carry the weights only, to and from the other formats (docs/architecture.md, checkpoints). The saver writes
a complete run directory (iteration `weights.iteration`, no optimizer, scheduler or RNG state) for a target
(TP, PP): load it with `--finetune` (or `--no-load-optim --no-load-rng`).
"""

from __future__ import annotations

import os

from megatron_train.arguments import MegatronConfig, config_from_dict, config_to_dict
from megatron_train.checkpointing import (
    FORMAT_VERSION,
    METADATA_FILENAME,
    SavedCheckpoint,
    checkpoint_dir,
    model_shard_dir,
    require_iteration_dir,
    sharding_record,
    write_metadata_and_marker,
    write_shard,
)
from megatron_train.checkpointing.layout import split_tp_shard, stage_tensor_names
from megatron_train.checkpointing.names import saved_model_type
from megatron_train.checkpointing.saved import saved_true_vocab_range
from megatron_train.convert.weights import (
    ModelWeights,
    model_shardings,
    pad_vocab,
    padded_vocab_for_layout,
    tokenizer_files_in,
    trim_vocab,
)
from megatron_train.models.transformer import get_layer_range
from storage.atomic import atomic_copy

TOKENIZER_FOLDER = "tokenizer"


def load(load_dir: str, iteration: int | None = None, true_vocab_size: int | None = None) -> ModelWeights:
    """The weights of `load_dir`'s checkpoint (latest, or `iteration`), whatever (TP, PP) wrote it."""
    iteration_dir = require_iteration_dir(load_dir, iteration)
    saved = SavedCheckpoint(iteration_dir)
    config = config_from_dict(saved.metadata["args"])
    true_vocab_size = true_vocab_size or config.model.true_vocab_size
    if true_vocab_size is None:
        low, high = saved_true_vocab_range(saved.metadata)
        if high - low != 1:
            raise ValueError(
                f"{iteration_dir} does not record its tokenizer's vocabulary size (between {low + 1} and "
                f"{high}): pass --true-vocab-size"
            )
        true_vocab_size = high
    config.model.true_vocab_size = true_vocab_size
    tensors = {name: saved.global_tensor(name) for name in saved.params}
    return ModelWeights(
        config,
        trim_vocab(tensors, true_vocab_size),
        tokenizer_files(config),
        saved.metadata["iteration"],
        saved.metadata.get("token_ids", {}),
        saved_model_type(saved.metadata),
    )


def tokenizer_files(config: MegatronConfig) -> dict[str, str]:
    """The files of the run's tokenizer under their Hugging Face names (GPT-2 BPE: vocab.json, merges.txt)."""
    tokenizer = config.tokenizer
    if tokenizer.tokenizer_type == "GPT2BPETokenizer" and tokenizer.vocab_file and tokenizer.merge_file:
        return {"vocab.json": tokenizer.vocab_file, "merges.txt": tokenizer.merge_file}
    if tokenizer.tokenizer_type == "HuggingFaceTokenizer" and tokenizer.tokenizer_model:
        if os.path.isdir(tokenizer.tokenizer_model):
            return tokenizer_files_in(tokenizer.tokenizer_model)
        return {"tokenizer.json": tokenizer.tokenizer_model}
    return {}


def save(weights: ModelWeights, save_dir: str, target_tp: int = 1, target_pp: int = 1) -> str:
    """Write `weights` as a checkpoint split for (target_tp, target_pp); returns the iteration folder.

    Tokenizer files go to `<save_dir>/tokenizer/`, which the saved args name (HuggingFaceTokenizer)."""
    config = weights.config
    padded_vocab_size = padded_vocab_for_layout(weights, target_tp, target_pp)
    out_dir = checkpoint_dir(save_dir, weights.iteration)
    if os.path.exists(os.path.join(out_dir, METADATA_FILENAME)):
        raise ValueError(
            f"{out_dir} already holds a complete checkpoint: delete it or pick another --save-dir"
        )
    config.parallel.tensor_model_parallel_size = target_tp
    config.parallel.pipeline_model_parallel_size = target_pp
    config.parallel.num_layers_per_virtual_pipeline_stage = None
    if weights.tokenizer_files:
        tokenizer_dir = os.path.abspath(os.path.join(save_dir, TOKENIZER_FOLDER))
        os.makedirs(tokenizer_dir, exist_ok=True)
        for name, source in weights.tokenizer_files.items():
            atomic_copy(source, os.path.join(tokenizer_dir, name))
        config.tokenizer.tokenizer_type, config.tokenizer.tokenizer_model = (
            "HuggingFaceTokenizer",
            tokenizer_dir,
        )
    tensors = pad_vocab(weights.tensors, padded_vocab_size)
    shardings = model_shardings(config, padded_vocab_size, weights.model_type)
    files = {}
    for pp_rank in range(target_pp):
        layers = get_layer_range(config.model.num_layers, pp_rank, target_pp)
        names = stage_tensor_names(list(shardings), layers, pp_rank == 0, pp_rank == target_pp - 1)
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
        "opt_param_scheduler": None,
        "args": config_to_dict(config),
        "token_ids": weights.token_ids,
        "model_type": weights.model_type,
    }
    write_metadata_and_marker(save_dir, weights.iteration, metadata, files)
    return out_dir
