"""Megatron's tokenizer flags, defined once for every entry point (see docs/architecture.md).

The flags are the fields of `TokenizerConfig` (`--tokenizer-type`, `--vocab-file`, `--merge-file`,
`--tokenizer-model`, `--vocab-size`, `--vocab-extra-ids`, `--make-vocab-size-divisible-by`): pretraining gets
them with the rest of Megatron's command line, a tool that needs only a tokenizer adds them with
`add_tokenizer_args` and builds it with `tokenizer_from_args`.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_train.config_flags import add_config_arguments
from megatron_train.tokenizer.base import MegatronTokenizer
from megatron_train.tokenizer.build import tokenizer_from_config
from megatron_train.training.config import TokenizerConfig


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """The tokenizer flags, as one argument group; a flag not given is absent from the parsed namespace."""
    add_config_arguments(parser.add_argument_group("tokenizer", TokenizerConfig.__doc__), TokenizerConfig)


def tokenizer_config_from_args(
    args: argparse.Namespace, base: TokenizerConfig | None = None
) -> TokenizerConfig:
    """`base` (default: Megatron's defaults) with every tokenizer flag given in `args` taking precedence."""
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TokenizerConfig)
        if getattr(args, f.name, None) is not None
    }
    return dataclasses.replace(base or TokenizerConfig(), **given)


def tokenizer_from_args(args: argparse.Namespace) -> MegatronTokenizer:
    """The tokenizer the flags of `add_tokenizer_args` describe."""
    return tokenizer_from_config(tokenizer_config_from_args(args))
