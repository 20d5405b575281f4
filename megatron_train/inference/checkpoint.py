"""Load a trained checkpoint and the tokenizer it was trained with, for generation and evaluation tools."""

from __future__ import annotations

import argparse

import torch

from megatron_train.tokenizer import MegatronTokenizer, build_tokenizer

TOKENIZER_FLAGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size")


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """--load, --iteration and Megatron's tokenizer flags (which override what the checkpoint recorded)."""
    parser.add_argument("--load", required=True, help="Checkpoint directory (a training run's --save).")
    parser.add_argument("--iteration", type=int, default=None, help="Iteration to load; default: the latest.")
    group = parser.add_argument_group("tokenizer (default: the one recorded in the checkpoint)")
    group.add_argument("--tokenizer-type", default=None)
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-model", default=None)
    group.add_argument("--vocab-size", type=int, default=None)


def load_for_inference(args: argparse.Namespace, device: torch.device | str | None = None):
    """(model in eval mode, tokenizer, MegatronConfig) from the flags of `add_checkpoint_args`."""
    from megatron_train.checkpointing import load_model_for_inference

    model, config = load_model_for_inference(args.load, iteration=args.iteration, device=device)
    return model.eval(), tokenizer_for(config, args, args.load), config


def tokenizer_for(config, args: argparse.Namespace, source: str) -> MegatronTokenizer:
    """The checkpoint's tokenizer, with any tokenizer flag given on the command line taking precedence."""
    settings = {name: getattr(config.tokenizer, name, None) for name in TOKENIZER_FLAGS}
    settings.update(
        {name: getattr(args, name) for name in TOKENIZER_FLAGS if getattr(args, name) is not None}
    )
    tokenizer_type = settings.pop("tokenizer_type")
    if tokenizer_type is None:
        raise ValueError(
            f"{source}: the checkpoint records no tokenizer; pass --tokenizer-type (and --vocab-file / "
            "--merge-file or --tokenizer-model) on the command line"
        )
    return build_tokenizer(tokenizer_type, **settings)
