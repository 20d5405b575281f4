"""Load a trained checkpoint and its tokenizer for the generation and evaluation tools, with Megatron's flags.

Megatron's tools (run_text_generation_server.py, tasks/main.py) parse the whole training command line plus
their own flags, so a user's training script runs them with its flags unchanged; ours do the same
(docs/architecture.md). The checkpoint decides the model, as Megatron's `--use-checkpoint-args` does: a model
shape flag given with `--load` must equal the saved value, flags that only concern training are accepted and
unused. Tokenizer flags replace the tokenizer the checkpoint recorded, and the tokenizer must fit the
checkpoint's vocabulary before anything is served or scored.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import torch.distributed as dist

from megatron_train.arguments import MegatronConfig, build_parser, flag_name
from megatron_train.checkpointing import MODEL_ARGS_TO_CHECK, CheckpointError, saved_true_vocab_range
from megatron_train.checkpointing.inference import model_from_saved, model_stage_from_saved
from megatron_train.checkpointing.saved import SavedCheckpoint
from megatron_train.convert.detect import open_checkpoint
from megatron_train.convert.flow import checked_saved_config
from megatron_train.families.family import ModelFamily
from megatron_train.families.registry import (
    DEFAULT_FAMILY,
    builtin_families,
    checkpoint_family,
    get_family,
    is_builtin,
    named_family,
)
from megatron_train.models.config import TransformerConfig
from megatron_train.parallel import state
from megatron_train.tokenizer import MegatronTokenizer, tokenizer_from_config
from megatron_train.tokenizer.flags import tokenizer_config_from_args
from megatron_train.training.config import TrainingConfig
from megatron_train.training.setup import initialize_distributed, print_parameter_count

_MODEL_FLAGS = {f.name: flag_name(f) for f in dataclasses.fields(TransformerConfig)}


def build_inference_parser(description: str) -> argparse.ArgumentParser:
    """Megatron's whole command line with only `--load` required; the tool adds its own flags to it."""
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[build_parser()],
        conflict_handler="resolve",  # a tool's own flag replaces a training flag of the same name
        allow_abbrev=False,
    )
    for action in parser._actions:
        action.required = action.dest == "load"
    return parser


def start_model_parallel(args: argparse.Namespace, data_parallel: bool) -> bool:
    """Under torchrun: join the process group and split it into model replicas of TP x PP ranks, several of
    them (data parallel) only where the tool splits its work over replicas (`data_parallel`; a server is one
    replica). True when this call created the process group (the caller destroys it)."""
    # Megatron's flags default to "not given" (the checkpoint decides); these have the training defaults.
    created = initialize_distributed(
        getattr(args, "distributed_timeout_minutes", TrainingConfig.distributed_timeout_minutes)
    )
    tp = getattr(args, "tensor_model_parallel_size", 1)
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    world = dist.get_world_size()
    if world != tp * pp and not (data_parallel and world % (tp * pp) == 0):
        replicas = "a multiple of " if data_parallel else ""
        raise ValueError(
            f"torchrun started {world} processes but --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}: pass --nproc-per-node {replicas}{tp * pp}"
        )
    state.initialize_model_parallel(tp, pp)
    return created


def check_model_flags(args: argparse.Namespace, saved: MegatronConfig, where: str) -> None:
    """Refuse a model shape flag given on the command line that differs from the checkpoint's saved value."""
    for name in MODEL_ARGS_TO_CHECK:
        given, recorded = getattr(args, name, None), getattr(saved.model, name)
        if given is not None and given != recorded:
            flag = _MODEL_FLAGS[name]
            raise ValueError(
                f"{flag} (given: {name}={given}) does not match checkpoint {where}, saved with "
                f"{name}={recorded}: drop {flag} (the checkpoint decides the model) or load a matching checkpoint"
            )


def tokenizer_for(saved: MegatronConfig, args: argparse.Namespace, where: str) -> MegatronTokenizer:
    """The checkpoint's tokenizer, with any tokenizer flag given on the command line taking precedence."""
    config = tokenizer_config_from_args(args, base=saved.tokenizer)
    if config.tokenizer_type is None and config.vocab_size is None:
        raise ValueError(
            f"{where}: the checkpoint records no tokenizer; pass --tokenizer-type (and --vocab-file / "
            "--merge-file or --tokenizer-model) on the command line"
        )
    return tokenizer_from_config(config)


def check_tokenizer_fits(tokenizer: MegatronTokenizer, metadata: dict, where: str) -> None:
    """The tokenizer's vocabulary must be one the checkpoint's padded embedding was made for: a smaller one
    decodes the model's ids to the wrong text, a larger one has ids past the embedding."""
    low, high = saved_true_vocab_range(metadata)
    if not low < tokenizer.vocab_size <= high:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but checkpoint {where} was trained with a "
            f"vocabulary of {low + 1} to {high} tokens (padded to {metadata['padded_vocab_size']}): pass the "
            "tokenizer flags it was trained with (--tokenizer-type, --vocab-file, --merge-file, "
            "--tokenizer-model, --vocab-size), or none to use the one it recorded"
        )


def add_family_flags(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> None:
    """The flags every project family's inference hooks add (Retro's index search settings), and those of the
    family `--model-family` names in `argv` (default the command line)."""
    families = list(builtin_families())
    named = named_family(sys.argv[1:] if argv is None else argv)
    if named is not None and not is_builtin(named):
        families.append(get_family(named))
    for family in families:
        if family.inference is not None and family.inference.add_flags is not None:
            family.inference.add_flags(parser)


def inference_checkpoint(args: argparse.Namespace) -> tuple[ModelFamily, SavedCheckpoint]:
    """(family, checkpoint) `--load` (`--ckpt-step`) names, ours or Megatron-LM's converted in memory (read as
    the family --model-family names, else GPT's), refusing one whose family the tools do not serve; nothing of
    its weights is read yet."""
    model_family = getattr(args, "model_family", None)
    saved = open_checkpoint(args.load, getattr(args, "ckpt_step", None), model_family or DEFAULT_FAMILY)
    if saved is None:
        raise CheckpointError(
            f"nothing saved in {args.load}: no latest marker; pass --ckpt-step or another --load"
        )
    family = checkpoint_family(saved.metadata, model_family, saved.iteration_dir)
    if family.inference is None:
        served = [f.name.upper() for f in builtin_families() if f.inference is not None]
        raise ValueError(
            f"checkpoint {saved.iteration_dir} holds a {family.name} model; generation and language-model "
            f"evaluation need a {' or '.join(served)} checkpoint (or one of a family with inference hooks)"
        )
    return family, saved


def load_for_inference(
    args: argparse.Namespace, device: torch.device | str | None = None
) -> tuple[torch.nn.Module, MegatronTokenizer, MegatronConfig]:
    """(model in eval mode, tokenizer, saved MegatronConfig) from the flags of `build_inference_parser`;
    the flags and the tokenizer are checked against the checkpoint before its weights are read. With
    model-parallel groups initialised the model is this rank's TP slice of its pipeline stage. The model is
    the one the family's inference hooks give (`InferenceHooks.prepare`: a Retro model retrieving its
    neighbours); a checkpoint of a family the tools do not serve is refused."""
    family, saved = inference_checkpoint(args)
    where, metadata = saved.iteration_dir, saved.metadata
    saved_config = checked_saved_config(saved, where, family)  # its args against its tensors, before building
    check_model_flags(args, saved_config, where)
    tokenizer = tokenizer_for(saved_config, args, where)
    check_tokenizer_fits(tokenizer, metadata, where)
    model_family = getattr(args, "model_family", None)
    if state.model_parallel_is_initialized():  # under torchrun: this rank's part of the model
        model, config = model_stage_from_saved(saved, device, model_family)
        print_parameter_count([model])
    else:
        model, config = model_from_saved(saved, device, model_family)
    if family.inference.prepare is not None:
        model = family.inference.prepare(model, tokenizer, args, device)
    return model.eval(), tokenizer, config
