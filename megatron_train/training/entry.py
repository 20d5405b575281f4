"""What every `pretrain_*` entry point does around its model-specific pieces (Megatron's pretrain_gpt.py,
pretrain_bert.py, pretrain_t5.py share this shape): parse the flags, refuse what the model cannot do, build the
tokenizer, size the vocabulary and hand the pieces to `training.loop.pretrain`. See docs/architecture.md."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from megatron_train.arguments import MegatronConfig, parse_args
from megatron_train.checkpointing.files import CheckpointError
from megatron_train.parallel.schedules import ForwardStepFunc
from megatron_train.tokenizer import MegatronTokenizer, tokenizer_from_config, vocab_size_with_padding
from megatron_train.training.loop import TrainingProgress, pretrain
from megatron_train.training.setup import ModelProvider

# datasets_provider(config, tokenizer, (train, valid, test) sample counts) -> (train, valid, test) datasets
ModelDatasetsProvider = Callable[[MegatronConfig, MegatronTokenizer, tuple[int, int, int]], tuple]

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


def model_build_options(config: MegatronConfig) -> dict[str, Any]:
    """The keyword arguments every model class takes from the run's flags: `--sequence-parallel`, and with
    `--use-cpu-initialization` the seed each part's weights are drawn from (the same full weights under every
    parallel layout)."""
    return {
        "sequence_parallel": config.parallel.sequence_parallel,
        "init_seed": config.training.seed if config.training.use_cpu_initialization else None,
    }


def run_pretrain(
    entry: str,
    argv: list[str] | None,
    model_provider: ModelProvider,
    datasets_provider: ModelDatasetsProvider,
    forward_step: ForwardStepFunc,
    *,
    refuse_per_token_loss_for: str | None = None,
    check_config: Callable[[MegatronConfig], None] | None = None,
) -> TrainingProgress:
    """Parse `argv`, check it, build the tokenizer and pretrain. `entry` names the entry point in errors.

    `forward_step` takes `per_token_loss=` (--calculate-per-token-loss, GPT's), unless
    `refuse_per_token_loss_for` names the model ("BERT") whose per-micro-batch loss refuses that flag.
    `check_config` raises SystemExit naming the flag for what else the model refuses."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    config = parse_args(argv)
    if check_config is not None:
        check_config(config)
    if refuse_per_token_loss_for is None:
        forward_step = functools.partial(
            forward_step, per_token_loss=config.training.calculate_per_token_loss
        )
    elif config.training.calculate_per_token_loss:
        raise SystemExit(
            f"{entry}: --calculate-per-token-loss is GPT's; Megatron's {refuse_per_token_loss_for} loss is per "
            "micro-batch"
        )
    try:
        tokenizer = tokenizer_from_config(config.tokenizer)
        return pretrain(
            config,
            model_provider,
            functools.partial(datasets_provider, config, tokenizer),
            forward_step,
            padded_vocab_size_for(config, tokenizer),
        )
    except USER_ERRORS as error:
        raise SystemExit(f"{entry}: {error}") from None
