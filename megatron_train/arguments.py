"""Megatron's command line, built from the typed config dataclasses, and the one config object it yields.

Every dataclass field becomes the flag Megatron users know (`num_layers` -> `--num-layers`; a field's
`metadata["flag"]` overrides the name; a bool that defaults to True gets `--no-<name>`). A field present in
several sections is one flag that sets all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_train.config_flags import add_config_arguments, flag_name, is_required
from megatron_train.data.config import DataConfig
from megatron_train.legacy_flags import TRAINING_FLAGS, add_legacy_flags
from megatron_train.models.config import TransformerConfig
from megatron_train.models.retro_config import RetroConfig
from megatron_train.parallel.config import ParallelConfig
from megatron_train.training.config import (
    CheckpointConfig,
    CompatibilityConfig,
    LoggingConfig,
    OptimizerConfig,
    TokenizerConfig,
    TrainingConfig,
)
from megatron_train.training.microbatches import parse_step_batch_size_schedule


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
    compat: CompatibilityConfig = field(default_factory=CompatibilityConfig)
    retro: RetroConfig = field(default_factory=RetroConfig)


SECTIONS: dict[str, type] = {
    "model": TransformerConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "tokenizer": TokenizerConfig,
    "compat": CompatibilityConfig,
    "retro": RetroConfig,
}

# What each accepted-only flag means here; parse_args logs the line of every one the command line gives.
ACCEPTED_FLAG_NOTES: dict[str, str] = {
    "use_mcore_models": "the models here are always Megatron-Core style; nothing to switch",
    "transformer_impl": "layers are torch modules whichever implementation is named",
    "attention_backend": "attention runs torch's scaled_dot_product_attention (flash-attn with --use-flash-attn)",
    "distributed_backend": "the backend follows the device: nccl on CUDA, gloo on CPU",
    "masked_softmax_fusion": "attention uses SDPA, which has no separate masked-softmax kernel",
    "cross_entropy_loss_fusion": "cross entropy is the vocab-parallel torch implementation either way",
    "create_attention_mask_in_dataloader": "the data loader never builds attention masks (attention is causal)",
    "mmap_bin_files": ".bin files are always memory-mapped (read-only, nothing is loaded up front)",
    "spec": "the model family builds its own layers (Megatron-Core's local spec names); no spec is imported",
    "ckpt_fully_parallel_load": "every rank reads only the torch_dist chunks it holds",
    "log_throughput": "every log line already carries 'throughput per GPU (TFLOP/s/GPU)'",
    "use_pytorch_profiler": "--profile always uses torch's profiler here",
    "dataset_impl": ".bin/.idx files are Megatron's mmap format, the only one here",
    "data_parallel_sharding_strategy": "Megatron ignores it without --use-megatron-fsdp, which is not built here: "
    "data parallelism replicates the model, and --use-distributed-optimizer shards the optimizer state (ZeRO-1)",
    "moe_permute_fusion": "MoE tokens are permuted with torch index operations (no fused kernel)",
    "moe_router_fusion": "the MoE router runs as torch operations (no fused kernel)",
    "moe_shared_expert_overlap": "the shared experts run after the token exchange (no CUDA-stream overlap)",
}
FP8_FLAGS = ("fp8_format", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_param_gather")
logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """One argument group per config section; shared fields are added once."""
    parser = argparse.ArgumentParser(
        description="Megatron-Flow training (Megatron-LM's flags)", allow_abbrev=False
    )
    seen: set[str] = set()
    for section, cls in SECTIONS.items():
        add_config_arguments(parser.add_argument_group(section, cls.__doc__), cls, seen)
    add_legacy_flags(parser, TRAINING_FLAGS)
    return parser


# With the weights' shape settings (checkpointing's MODEL_ARGS_TO_CHECK), the model's architecture that
# --use-checkpoint-args takes from the checkpoint: Megatron's list (load_args_from_checkpoint) under our names.
ARCHITECTURE_ARGS = (
    "seq_length", "rotary_percent", "rotary_base", "use_rope_scaling", "rope_scaling_factor", "norm_epsilon",
    "apply_layernorm_1p", "openai_gelu", "bias_gelu_fusion", "true_vocab_size", "decoder_seq_length",
    "relative_attention_max_distance",
)  # fmt: skip
ALIASES = {
    "num_layers": "encoder_num_layers",
    "seq_length": "encoder_seq_length",
}  # T5's names of the same flags


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> MegatronConfig:
    """Parse Megatron flags into a validated MegatronConfig (exits with the reason on a bad combination)."""
    parser = build_parser()
    required = [action for action in parser._actions if action.required]
    for action in required:  # --use-checkpoint-args may fill them: checked below
        action.required = False
    values = vars(parser.parse_args(argv))
    try:
        if values.get("use_checkpoint_args"):
            take_checkpoint_args(values, parser)
        missing = [action.option_strings[0] for action in required if action.dest not in values]
        if missing:
            raise ValueError(f"the following arguments are required: {', '.join(missing)}")
        config = MegatronConfig(
            **{
                name: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
                for name, cls in SECTIONS.items()
            }
        )
        refuse_fp8(values)
        validate_config(
            config, world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        )
    except ValueError as error:
        parser.error(str(error))
    if int(os.environ.get("RANK", "0")) == 0:
        for name, note in ACCEPTED_FLAG_NOTES.items():
            if name in values:
                value = "" if isinstance(values[name], bool) else f" {values[name]}"
                logger.info("%s%s: %s", _flag_of(name), value, note)
    return config


def take_checkpoint_args(values: dict[str, Any], parser: argparse.ArgumentParser) -> None:
    """Megatron's --use-checkpoint-args: the architecture and tokenizer settings the command line leaves out
    are set from the checkpoint in --load (logging each, as Megatron); given ones stay, and loading then refuses
    any that differ from the checkpoint. Without a checkpoint the command line's settings are used. A saved value
    the flag itself would refuse is refused, naming the file."""
    from megatron_train.checkpointing import (
        MODEL_ARGS_TO_CHECK,
        CheckpointError,
        read_metadata,
        resolve_iteration_dir,
    )

    load = values.get("load")
    log = logger.info if int(os.environ.get("RANK", "0")) == 0 else logger.debug
    try:
        iteration_dir = resolve_iteration_dir(load, values.get("ckpt_step")) if load else None
        metadata = read_metadata(iteration_dir) if iteration_dir is not None else None
    except CheckpointError as error:
        raise ValueError(f"--use-checkpoint-args: {error}") from None
    if metadata is None:
        log(
            "--use-checkpoint-args: no checkpoint in --load %s to provide arguments, using the given ones",
            load,
        )
        return
    where = f"{iteration_dir}/metadata.json"
    saved = metadata.get("args")
    if not isinstance(saved, dict) or not all(
        isinstance(saved.get(s, {}), dict) for s in ("model", "tokenizer")
    ):
        raise ValueError(f"--use-checkpoint-args: {where} records no model and tokenizer arguments")
    actions = {action.dest: action for action in parser._actions}
    taken = [("model", name) for name in (*MODEL_ARGS_TO_CHECK, *ARCHITECTURE_ARGS)]
    taken += [("tokenizer", f.name) for f in dataclasses.fields(TokenizerConfig)]
    for section, name in taken:
        value = saved.get(section, {}).get(name)
        if value is None or name in values or ALIASES.get(name) in values:
            continue
        if not _valid_flag_value(actions[name], value):
            raise ValueError(
                f"--use-checkpoint-args: {where} records {name}={value!r}, not a {_flag_of(name)} value"
            )
        values[name] = value
        log("Setting %s to %s from checkpoint", name, value)


def _valid_flag_value(action: argparse.Action, value: Any) -> bool:
    """Whether `value` is one the flag's parser action yields: a bool for a switch, else its type and choices."""
    if action.nargs == 0:
        return isinstance(value, bool)
    values = value if isinstance(value, list) and action.nargs is not None else [value]
    return all(
        not isinstance(v, bool)
        and (
            action.type is None or isinstance(v, action.type) or (action.type is float and isinstance(v, int))
        )
        and (action.choices is None or v in action.choices)
        for v in values
    )


def _flag_of(name: str) -> str:
    return next(flag_name(f) for cls in SECTIONS.values() for f in dataclasses.fields(cls) if f.name == name)


def refuse_fp8(given: dict[str, Any]) -> None:
    """FP8 needs Transformer Engine on an FP8 GPU (compute capability 8.9+); name the flag when that is missing."""
    flags = [name for name in FP8_FLAGS if name in given]
    if not flags:
        return
    fp8_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    missing = "an FP8 GPU (compute capability 8.9+: Ada, Hopper, Blackwell)" if not fp8_gpu else ""
    if fp8_gpu and importlib.util.find_spec("transformer_engine") is None:
        missing = "Transformer Engine (pip install transformer_engine[pytorch])"
    missing = missing or "FP8 layers, which this engine does not build yet"
    raise ValueError(
        f"{_flag_of(flags[0])} asks for FP8 training, which needs {missing}; drop the "
        f"{' '.join(_flag_of(name) for name in flags)} flag(s) to train in --bf16"
    )


def validate_config(config: MegatronConfig, world_size: int) -> None:
    """Megatron's cross-argument rules (validate_args); fills derived defaults in place."""
    training, opt, parallel = config.training, config.optimizer, config.parallel
    dp = parallel.data_parallel_size(world_size)
    if training.grad_reduce_in_bf16 and not config.model.bf16:
        raise ValueError("--grad-reduce-in-bf16 reduces bf16 grads: it needs --bf16")
    if config.model.bf16 and not training.grad_reduce_in_bf16:
        training.accumulate_allreduce_grads_in_fp32 = True  # as Megatron: bf16 grads are reduced in fp32
    validate_step_batch_size_schedule(config)
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
    if training.overlap_param_gather and not (
        parallel.use_distributed_optimizer and training.overlap_grad_reduce
    ):
        raise ValueError(
            "--overlap-param-gather overlaps the distributed optimizer's param all-gather: it needs "
            "--use-distributed-optimizer and --overlap-grad-reduce (as in Megatron)"
        )
    validate_moe(config, world_size)
    validate_context_parallel(config)
    validate_checkpoint_flags(config)
    logging_config = config.logging
    if logging_config.profile and logging_config.profile_step_end <= logging_config.profile_step_start:
        raise ValueError(
            f"--profile-step-end {logging_config.profile_step_end} must be after --profile-step-start "
            f"{logging_config.profile_step_start}"
        )
    if training.manual_gc_interval < 0:
        raise ValueError(f"--manual-gc-interval must be >= 0, got {training.manual_gc_interval}")
    if config.model.seq_length is None:
        raise ValueError("set --seq-length")


def validate_checkpoint_flags(config: MegatronConfig) -> None:
    """Megatron's rules for the torch_dist flags: --async-save writes torch_dist only; non-persistent
    checkpoints are global run directories here (local and in-memory ones need nvidia-resiliency-ext)."""
    ckpt = config.checkpoint
    if ckpt.ckpt_format == "torch":
        logger.info(
            "--ckpt-format torch: checkpoints are saved in the run-directory format that reshards across layouts "
            "(checkpoint_util --saver megatron writes Megatron's legacy files from them)"
        )
    if ckpt.async_save and ckpt.ckpt_format != "torch_dist":
        raise ValueError("--async-save writes torch_dist checkpoints: add --ckpt-format torch_dist")
    if ckpt.non_persistent_save_interval is not None:
        if ckpt.non_persistent_save_interval < 1:
            raise ValueError(
                f"--non-persistent-save-interval must be >= 1, got {ckpt.non_persistent_save_interval}"
            )
        if ckpt.non_persistent_ckpt_type is None:
            ckpt.non_persistent_ckpt_type = "global"
        if ckpt.save is None and ckpt.non_persistent_global_ckpt_dir is None:
            raise ValueError(
                "--non-persistent-save-interval needs --save or --non-persistent-global-ckpt-dir <directory>"
            )
    if ckpt.non_persistent_ckpt_type in ("local", "in_memory"):
        raise ValueError(
            f"--non-persistent-ckpt-type {ckpt.non_persistent_ckpt_type} needs nvidia-resiliency-ext's local "
            "checkpoint manager, which this engine does not use: pass --non-persistent-ckpt-type global"
        )


def validate_context_parallel(config: MegatronConfig) -> None:
    """What --context-parallel-size needs (as Megatron): the sequence cut into 2 x CP equal chunks (each a multiple
    of TP under sequence parallelism), no attention dropout (the ring's blocks draw no masks here), no
    flash-attn kernel (the ring computes its blocks itself) and --cp-comm-type a2a's heads split evenly."""
    cp, model = config.parallel.context_parallel_size, config.model
    if cp == 1:
        return
    tp = config.parallel.tensor_model_parallel_size
    multiple = 2 * cp * (tp if config.parallel.sequence_parallel else 1)
    if model.seq_length % multiple:
        split = f" x --tensor-model-parallel-size {tp} (--sequence-parallel)" if multiple != 2 * cp else ""
        raise ValueError(
            f"--seq-length {model.seq_length} is not divisible by 2 x --context-parallel-size {cp}{split} = "
            f"{multiple}: each sequence is cut into {2 * cp} equal chunks (causal load balance); change the "
            "sequence length or the parallel sizes"
        )
    if model.attention_dropout > 0:
        raise ValueError(
            f"--context-parallel-size {cp} needs --attention-dropout 0 (got {model.attention_dropout}): the "
            "ring attention here computes its blocks without dropout"
        )
    if model.use_flash_attn:
        raise ValueError(
            f"--use-flash-attn with --context-parallel-size {cp}: context-parallel attention computes its blocks "
            "itself; drop --use-flash-attn"
        )
    groups = model.num_query_groups_effective // tp
    if model.cp_comm_type == "a2a" and groups % cp:
        raise ValueError(
            f"--cp-comm-type a2a splits each tensor-parallel rank's {groups} key/value heads over "
            f"--context-parallel-size {cp}, which does not divide them; use --cp-comm-type p2p or all_gather"
        )


def validate_moe(config: MegatronConfig, world_size: int) -> None:
    """Megatron's rules for expert parallelism and the MoE layers (the MoE flags alone: MoEConfig.moe_checks)."""
    model, parallel, compat = config.model, config.parallel, config.compat
    if compat.moe_enable_deepep or compat.moe_flex_dispatcher_backend is not None:
        flag = "--moe-enable-deepep" if compat.moe_enable_deepep else "--moe-flex-dispatcher-backend"
        raise ValueError(
            f"{flag} asks for DeepEP / HybridEP's fused GPU all-to-all kernels, which this engine does not have; drop "
            "it and use --moe-token-dispatcher-type alltoall"
        )
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_size
    if not model.is_moe:
        if ep > 1:
            raise ValueError(f"--expert-model-parallel-size {ep} splits MoE experts: it needs --num-experts")
        return
    parallel.expert_data_parallel_size(world_size)
    checks = [
        (
            model.num_experts % ep == 0,
            f"--num-experts {model.num_experts} is not a multiple of --expert-model-parallel-size {ep}",
        ),
        (
            model.moe_ffn_hidden_size % etp == 0,
            f"--moe-ffn-hidden-size {model.moe_ffn_hidden_size} is not divisible by the expert tensor parallel size "
            f"{etp} (--expert-tensor-parallel-size, default --tensor-model-parallel-size)",
        ),
        (
            not model.add_bias_linear or etp == 1,
            "MoE experts have biases only with --expert-tensor-parallel-size 1 (as Megatron); pass "
            "--disable-bias-linear or --expert-tensor-parallel-size 1",
        ),
        (
            parallel.tensor_model_parallel_size == 1 or parallel.sequence_parallel,
            "MoE layers with --tensor-model-parallel-size > 1 need --sequence-parallel (as Megatron): each TP rank "
            "routes its own share of the tokens",
        ),
        (
            config.training.ddp_impl == "local" or ep == 1,
            "--ddp-impl torch averages every gradient over data parallel; expert parallelism needs --ddp-impl local",
        ),
        (
            not model.moe_use_upcycling or (config.checkpoint.load and config.checkpoint.save),
            "--moe-use-upcycling turns the dense checkpoint of --load into an MoE run saved to --save: give both",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def validate_step_batch_size_schedule(config: MegatronConfig) -> None:
    """Megatron refuses --global-batch-size beside a schedule; its own GPT-3 example passes both, so we accept
    a --global-batch-size equal to the schedule's last batch size (the one the run ends with)."""
    training = config.training
    if training.step_batch_size_schedule is None:
        return
    if training.rampup_batch_size is not None:
        raise ValueError("--step-batch-size-schedule and --rampup-batch-size exclude each other; keep one")
    schedule = parse_step_batch_size_schedule(training.step_batch_size_schedule, config.model.seq_length)
    final = schedule[-1][1]
    if training.global_batch_size not in (None, final):
        raise ValueError(
            f"--global-batch-size {training.global_batch_size} differs from the last batch size {final} of "
            f"--step-batch-size-schedule {' '.join(training.step_batch_size_schedule)!r}; drop "
            "--global-batch-size"
        )
    training.global_batch_size = final


def validate_pipeline_parallel(config: MegatronConfig, data_parallel_size: int) -> None:
    """Megatron's pipeline rules: every stage (and virtual stage) holds as many layers as the others, and the
    interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size."""
    parallel, training = config.parallel, config.training
    pp = parallel.pipeline_model_parallel_size
    model = config.model
    if model.hybrid_layer_pattern is None:
        parallel.check_num_layers(
            model.num_layers,
            model.num_layers_in_first_pipeline_stage,
            model.num_layers_in_last_pipeline_stage,
        )
    else:  # a hybrid model's stages are its pattern's segments, of any sizes
        uneven = [
            flag
            for flag, value in (
                ("--num-layers-in-first-pipeline-stage", model.num_layers_in_first_pipeline_stage),
                ("--num-layers-in-last-pipeline-stage", model.num_layers_in_last_pipeline_stage),
            )
            if value is not None
        ]
        if uneven:
            raise ValueError(
                f"{uneven[0]}: a hybrid model's pipeline stages are the segments of --hybrid-layer-pattern "
                f"between '|' ({model.hybrid_layer_pattern!r}); drop the flag and move the '|' instead"
            )
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
    if training.step_batch_size_schedule is not None:  # so does every batch size of the schedule
        schedule = parse_step_batch_size_schedule(training.step_batch_size_schedule, config.model.seq_length)
        batch_sizes.update(size for _, size in schedule)
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


# Settings added after checkpoints were first saved, with the value those checkpoints (which lack them) ran with
# where it differs from the new default: the MLP's exact GELU before Megatron's bias-GELU fusion (tanh) existed.
BEFORE_ADDED: dict[str, dict[str, Any]] = {"model": {"bias_gelu_fusion": False}}


def config_from_dict(values: dict[str, dict[str, Any]]) -> MegatronConfig:
    """Inverse of `config_to_dict`; keys this version does not know are ignored, missing ones take defaults
    (or, for a setting in BEFORE_ADDED, the value the checkpoint was computed with)."""
    sections = {}
    for name, cls in SECTIONS.items():
        known = {f.name for f in dataclasses.fields(cls)}
        given = values.get(name, {})
        before = {k: v for k, v in BEFORE_ADDED.get(name, {}).items() if name in values and k not in given}
        sections[name] = cls(**before, **{k: v for k, v in given.items() if k in known})
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
            if not is_required(f) and value == _default(f):
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
