"""What every `pretrain_*` entry point does around its model family (Megatron's pretrain_gpt.py, pretrain_bert.py,
pretrain_t5.py, pretrain_retro.py share this shape): parse the flags, refuse what the family cannot do, build the
tokenizer, size the vocabulary and hand the family's pieces to `training.loop.pretrain`. See
docs/architecture.md (model families)."""

from __future__ import annotations

import functools
import logging
import sys

from megatron_train.arguments import MegatronConfig, parse_args
from megatron_train.checkpointing.files import CheckpointError
from megatron_train.families.family import ModelFamily
from megatron_train.families.registry import get_family, named_family
from megatron_train.tokenizer import MegatronTokenizer, tokenizer_from_config, vocab_size_with_padding
from megatron_train.training.loop import TrainingProgress, pretrain

# What the user's flags and files cause (a missing or truncated file, a flag value the data or model cannot take,
# a checkpoint that does not match the flags): each names the file or flag, so it ends the run in one line
# (`<entry>: <reason>`, on every rank that hit it) rather than a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, CheckpointError)


def padded_vocab_size_for(config: MegatronConfig, tokenizer: MegatronTokenizer) -> int:
    """Record the tokenizer's vocabulary size as the model's true one (its padding rows are masked out of the
    loss) and return the padded size (--make-vocab-size-divisible-by x TP) the model is built with."""
    if config.model.true_vocab_size is None:
        config.model.true_vocab_size = tokenizer.vocab_size
    elif config.model.true_vocab_size != tokenizer.vocab_size:
        raise SystemExit(
            f"--true-vocab-size {config.model.true_vocab_size} differs from the tokenizer's vocabulary size "
            f"{tokenizer.vocab_size}; drop the flag or use the matching tokenizer"
        )
    return vocab_size_with_padding(
        tokenizer.vocab_size,
        config.tokenizer.make_vocab_size_divisible_by,
        config.parallel.tensor_model_parallel_size,
    )


def check_family_config(family: ModelFamily, config: MegatronConfig) -> None:
    """What the family refuses of a run, as ValueErrors naming the flag: a parallel layout it is not split along,
    --calculate-per-token-loss for a loss per micro-batch, --ckpt-format torch_dist where its layers have no
    Megatron-Core names, MoE layers where it has none, and its own checks."""
    family.layouts.check(family.name, config)
    if config.model.is_moe and not family.mixture_of_experts:
        raise ValueError(
            f"--num-experts {config.model.num_experts}: the {family.name} model has no MoE layers here (GPT has)"
        )

    if config.training.calculate_per_token_loss and not family.per_token_loss:
        raise ValueError(
            f"--calculate-per-token-loss is GPT's; Megatron's {family.name.upper()} loss is per micro-batch"
        )
    if config.checkpoint.ckpt_format == "torch_dist":
        names = family.megatron_names
        why = "it has no Megatron-LM names" if names is None else names.torch_dist
        if why is not None:
            raise ValueError(
                f"--ckpt-format torch_dist: the {family.name} family is not saved in Megatron-Core's torch_dist "
                f"({why}); leave --ckpt-format out to save in our format"
            )
    if family.check_config is not None:
        family.check_config(config)


def run_pretrain(entry: str, argv: list[str] | None, default_family: str) -> TrainingProgress:
    """Train the family `--model-family` names (default `default_family`, the entry point's own) with the flags
    `argv` (default the command line). `entry` names the entry point in errors."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    try:
        family = get_family(named_family(argv) or default_family)
        if family.datasets_provider is None:
            raise ValueError(
                f"the {family.name} family is not pretrained: its checkpoints come from {family.entry}"
            )
        if family.prepare_argv is not None:
            argv = family.prepare_argv(argv)
        config = parse_args(argv)
        check_family_config(family, config)
        forward_step = family.forward_step
        if family.per_token_loss:
            forward_step = functools.partial(
                forward_step, per_token_loss=config.training.calculate_per_token_loss
            )
        model_provider = (
            family.model_provider if family.run_model_provider is None else family.run_model_provider(config)
        )
        tokenizer = tokenizer_from_config(config.tokenizer)
        padded_vocab_size = padded_vocab_size_for(config, tokenizer)
        return pretrain(
            config,
            model_provider,
            functools.partial(family.datasets_provider, config, tokenizer),
            forward_step,
            padded_vocab_size,
            family.terms(config, padded_vocab_size),
        )
    except USER_ERRORS as error:
        raise SystemExit(f"{entry}: {error}") from None
