"""A checkpoint as one model for generation, evaluation and serving (docs/architecture.md, checkpoints)."""

from __future__ import annotations

import torch

from megatron_train.arguments import MegatronConfig, config_from_dict
from megatron_train.checkpointing.files import (
    TRACKER_FILENAME,
    CheckpointError,
    complete_iterations,
    resolve_iteration_dir,
)
from megatron_train.checkpointing.load import load_model_weights
from megatron_train.checkpointing.names import current_expert_layout, global_names
from megatron_train.checkpointing.saved import SavedCheckpoint
from megatron_train.device import get_device
from megatron_train.families.family import ModelFamily
from megatron_train.families.registry import checkpoint_family
from megatron_train.parallel import state
from megatron_train.tokenizer import vocab_size_with_padding


def open_saved_checkpoint(load_dir: str, iteration: int | None) -> tuple[str, SavedCheckpoint]:
    """(iteration folder, its SavedCheckpoint) of `iteration` in `load_dir`, the latest when None."""
    iteration_dir = resolve_iteration_dir(load_dir, iteration)
    if iteration_dir is None:
        raise CheckpointError(
            f"no {TRACKER_FILENAME} in {load_dir} (complete iterations there: {complete_iterations(load_dir)}): "
            "pass iteration= or a directory with a save"
        )
    return iteration_dir, SavedCheckpoint(iteration_dir)


def saved_config_for_layout(saved: SavedCheckpoint, tp_size: int, pp_size: int) -> MegatronConfig:
    """The config the checkpoint was trained with, set to the (TP, PP) layout it is loaded under; inference
    runs without sequence parallelism."""
    config = config_from_dict(saved.metadata["args"])
    config.parallel.tensor_model_parallel_size = tp_size
    config.parallel.pipeline_model_parallel_size = pp_size
    config.parallel.sequence_parallel = False
    return config


def load_model_for_inference(
    load_dir: str,
    iteration: int | None = None,
    device: torch.device | str | None = None,
    model_family: str | None = None,
) -> tuple[torch.nn.Module, MegatronConfig]:
    """The saved model (its family's, as the checkpoint records: `families.registry.checkpoint_family`, with
    `model_family` the --model-family a family from outside the project needs) in eval mode with the
    checkpoint's weights, and the config it was trained with.

    Single process: the TP shards and PP stages of any saved layout are merged into one model; every file is
    verified against its recorded hash, so a damaged checkpoint fails naming the file.
    """
    return model_from_saved(open_saved_checkpoint(load_dir, iteration)[1], device, model_family)


def model_from_saved(
    saved: SavedCheckpoint, device: torch.device | str | None = None, model_family: str | None = None
) -> tuple[torch.nn.Module, MegatronConfig]:
    """`load_model_for_inference` of a checkpoint already opened (ours, or one converted in memory)."""
    family = checkpoint_family(saved.metadata, model_family, saved.iteration_dir)
    config = saved_config_for_layout(saved, tp_size=1, pp_size=1)
    model = family.model_provider(config, saved.padded_vocab_size)
    names = {name: name for name in model.state_dict()}
    load_model_weights(model, saved, names, saved.padded_vocab_size, tp_size=1, tp_rank=0)
    model.to(device=device or get_device(), dtype=config.model.params_dtype)
    model.eval()
    return model, config


def load_model_stage_for_inference(
    load_dir: str,
    iteration: int | None = None,
    device: torch.device | str | None = None,
    model_family: str | None = None,
) -> tuple[torch.nn.Module, MegatronConfig]:
    """This rank's part of a saved model under the model-parallel groups already initialised: its TP slice of
    its pipeline stage's layers (embedding on the first stage, output layer on the last), in eval mode. The
    layout must be one the checkpoint's family is split along (`ModelFamily.layouts`).

    The checkpoint may have been saved under any (TP, PP) layout: each weight is resharded on load; the
    vocabulary is padded further when this TP size needs it (padding rows are never predicted).
    """
    return model_stage_from_saved(open_saved_checkpoint(load_dir, iteration)[1], device, model_family)


def model_stage_from_saved(
    saved: SavedCheckpoint, device: torch.device | str | None = None, model_family: str | None = None
) -> tuple[torch.nn.Module, MegatronConfig]:
    """`load_model_stage_for_inference` of a checkpoint already opened (ours, or one converted in memory)."""
    family = checkpoint_family(saved.metadata, model_family, saved.iteration_dir)
    tp_size, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    config = saved_config_for_layout(saved, tp_size, state.get_pipeline_model_parallel_world_size())
    check_serving_layout(family, config, saved.iteration_dir)
    padded_vocab_size = vocab_size_with_padding(
        saved.padded_vocab_size, config.tokenizer.make_vocab_size_divisible_by, tp_size
    )
    if (
        config.model.true_vocab_size is None
    ):  # the rows this TP size adds are padding, never scored or predicted
        config.model.true_vocab_size = saved.padded_vocab_size
    model = family.model_provider(
        config, padded_vocab_size, state.is_pipeline_first_stage(), state.is_pipeline_last_stage()
    )
    load_model_weights(
        model,
        saved,
        global_names(model, config),
        padded_vocab_size,
        tp_size,
        tp_rank,
        current_expert_layout(),
    )
    model.to(device=device or get_device(), dtype=config.model.params_dtype)
    return model.eval(), config


def check_serving_layout(family: ModelFamily, config: MegatronConfig, where: str) -> None:
    """Refuse a (TP, PP) serving layout the checkpoint's family is not split along, naming the flag."""
    try:
        family.layouts.check(family.name, config)
    except ValueError as error:
        raise CheckpointError(f"checkpoint {where} holds a {family.name} model: {error}") from None
