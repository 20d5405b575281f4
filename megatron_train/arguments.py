"""Megatron's command line, built from the typed config dataclasses, and the one config object it yields.

Every dataclass field becomes the flag Megatron users know (`num_layers` -> `--num-layers`; a field's
`metadata["flag"]` overrides the name; a bool that defaults to True gets `--no-<name>`). A field present in
several sections is one flag that sets all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_train.data.config import DataConfig
from megatron_train.models.config import TransformerConfig
from megatron_train.parallel.config import ParallelConfig
from megatron_train.training.config import (
    CheckpointConfig,
    LoggingConfig,
    OptimizerConfig,
    TokenizerConfig,
    TrainingConfig,
)


@dataclass
class MegatronConfig:
    """All settings of one training run, grouped as Megatron groups its arguments."""

    model: TransformerConfig
    data: DataConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)


SECTIONS: dict[str, type] = {
    "model": TransformerConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "tokenizer": TokenizerConfig,
}


def flag_name(f: dataclasses.Field) -> str:
    """The command-line flag of a config field."""
    if "flag" in f.metadata:
        return f.metadata["flag"]
    prefix = "--no-" if f.default is True else "--"
    return prefix + f.name.replace("_", "-")


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _argument_kwargs(f: dataclasses.Field, annotation: Any) -> dict[str, Any]:
    kind = _strip_optional(annotation)
    kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata.get("help")}
    if kind is bool:
        kwargs["action"] = "store_false" if f.default is True else "store_true"
        return kwargs
    if typing.get_origin(kind) is list:
        (kwargs["type"],) = typing.get_args(kind)
        kwargs["nargs"] = f.metadata.get("nargs", "+")
    elif typing.get_origin(kind) is Literal:
        kwargs["choices"] = typing.get_args(kind)
        kwargs["type"] = type(kwargs["choices"][0])
    else:
        kwargs["type"] = kind
    kwargs["required"] = _is_required(f)
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    """One argument group per config section; shared fields are added once."""
    parser = argparse.ArgumentParser(
        description="Megatron-Flow training (Megatron-LM's flags)", allow_abbrev=False
    )
    seen: set[str] = set()
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section, cls.__doc__)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            group.add_argument(flag_name(f), **_argument_kwargs(f, hints[f.name]))
    return parser


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> MegatronConfig:
    """Parse Megatron flags into a validated MegatronConfig (exits with the reason on a bad combination)."""
    parser = build_parser()
    values = vars(parser.parse_args(argv))
    try:
        config = MegatronConfig(
            **{
                name: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
                for name, cls in SECTIONS.items()
            }
        )
        validate_config(
            config, world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        )
    except ValueError as error:
        parser.error(str(error))
    return config


def validate_config(config: MegatronConfig, world_size: int) -> None:
    """Megatron's cross-argument rules (validate_args); fills derived defaults in place."""
    training, opt, parallel = config.training, config.optimizer, config.parallel
    dp = parallel.data_parallel_size(world_size)
    if config.model.bf16:
        training.accumulate_allreduce_grads_in_fp32 = True  # as Megatron: bf16 grads are reduced in fp32
    if training.global_batch_size is None:
        training.global_batch_size = training.micro_batch_size * dp
    if training.global_batch_size % (training.micro_batch_size * dp):
        raise ValueError(
            f"--global-batch-size {training.global_batch_size} is not a multiple of --micro-batch-size "
            f"{training.micro_batch_size} x data-parallel size {dp}"
        )
    if (training.train_iters is None) == (training.train_samples is None):
        raise ValueError("set exactly one of --train-iters and --train-samples")
    if training.train_iters is not None:
        if opt.lr_decay_samples is not None or opt.lr_warmup_samples:
            raise ValueError(
                "with --train-iters use --lr-decay-iters / --lr-warmup-iters, not the *-samples flags"
            )
        if training.rampup_batch_size is not None:
            raise ValueError("--rampup-batch-size needs sample-based training: use --train-samples")
        decay_iters = opt.lr_decay_iters if opt.lr_decay_iters is not None else training.train_iters
        if opt.lr_decay_style != "constant" and opt.lr_warmup_iters and opt.lr_warmup_iters >= decay_iters:
            raise ValueError(
                f"--lr-warmup-iters {opt.lr_warmup_iters} must be below the decay iterations ({decay_iters}: "
                "--lr-decay-iters, else --train-iters); lower it or use --lr-warmup-fraction"
            )
    if training.train_samples is not None and (opt.lr_decay_iters is not None or opt.lr_warmup_iters):
        raise ValueError(
            "with --train-samples use --lr-decay-samples / --lr-warmup-samples, not the *-iters flags"
        )
    if opt.lr_warmup_fraction is not None and (opt.lr_warmup_iters or opt.lr_warmup_samples):
        raise ValueError("--lr-warmup-fraction excludes --lr-warmup-iters and --lr-warmup-samples")
    if opt.lr is None:
        raise ValueError("set --lr")
    if config.checkpoint.save_interval is not None and config.checkpoint.save is None:
        raise ValueError("--save-interval needs --save <directory>")
    if parallel.tensor_model_parallel_size == 1:
        parallel.sequence_parallel = False  # as Megatron: nothing to split
    validate_pipeline_parallel(config, dp)
    if parallel.use_distributed_optimizer and training.ddp_impl != "local":
        raise ValueError(
            "--use-distributed-optimizer shards the local DDP's grad buffer: use --ddp-impl local"
        )
    if config.model.seq_length is None:
        raise ValueError("set --seq-length")


def validate_pipeline_parallel(config: MegatronConfig, data_parallel_size: int) -> None:
    """Megatron's pipeline rules: every stage (and virtual stage) holds as many layers as the others, and the
    interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size."""
    parallel, training = config.parallel, config.training
    pp = parallel.pipeline_model_parallel_size
    parallel.check_num_layers(config.model.num_layers)
    if pp > 1 and training.ddp_impl != "local":
        raise ValueError(
            "--pipeline-model-parallel-size > 1 needs --ddp-impl local: torch's DDP decides at forward time "
            "whether to reduce grads, which the pipeline schedules' interleaved forwards and backwards break"
        )
    if parallel.num_layers_per_virtual_pipeline_stage is None:
        return
    if pp == 1:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage splits pipeline stages into virtual stages: it needs "
            "--pipeline-model-parallel-size > 1"
        )
    micro_batch_times_dp = training.micro_batch_size * data_parallel_size
    batch_sizes = {training.global_batch_size}
    if training.rampup_batch_size is not None:  # every global batch size of the ramp runs the schedule
        start, increment, _ = training.rampup_batch_size
        batch_sizes.update(range(start, training.global_batch_size, increment))
    for batch_size in sorted(batch_sizes):
        num_micro_batches = batch_size // micro_batch_times_dp
        if num_micro_batches % pp:
            raise ValueError(
                f"the interleaved schedule (--num-layers-per-virtual-pipeline-stage) needs the number of "
                f"micro-batches per step to be a multiple of --pipeline-model-parallel-size {pp}, but global "
                f"batch size {batch_size} / (--micro-batch-size {training.micro_batch_size} x data-parallel "
                f"size {data_parallel_size}) = {num_micro_batches}; change --global-batch-size or "
                "--micro-batch-size"
            )


def config_to_dict(config: MegatronConfig) -> dict[str, dict[str, Any]]:
    """JSON-able form, stored in checkpoints and stage manifests."""
    return {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}


def config_from_dict(values: dict[str, dict[str, Any]]) -> MegatronConfig:
    """Inverse of `config_to_dict`; keys this version does not know are ignored, missing ones take defaults."""
    sections = {}
    for name, cls in SECTIONS.items():
        known = {f.name for f in dataclasses.fields(cls)}
        sections[name] = cls(**{k: v for k, v in values.get(name, {}).items() if k in known})
    return MegatronConfig(**sections)


def config_to_argv(config: MegatronConfig) -> list[str]:
    """The flags that reproduce `config` (only settings that differ from the defaults, plus required ones)."""
    argv: list[str] = []
    seen: set[str] = set()
    for name, cls in SECTIONS.items():
        section = getattr(config, name)
        for f in dataclasses.fields(cls):
            if f.name in seen:
                continue
            seen.add(f.name)
            value = getattr(section, f.name)
            if not _is_required(f) and value == _default(f):
                continue
            if isinstance(value, bool):
                argv.append(flag_name(f))
            elif isinstance(value, list):
                argv += [flag_name(f), *(str(v) for v in value)]
            elif value is not None:
                argv += [flag_name(f), str(value)]
    return argv


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
