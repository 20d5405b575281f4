"""Typed settings of the training engine: one dataclass per Megatron argument group.

Field names are Megatron's flag names with underscores (`micro_batch_size` <-> `--micro-batch-size`) and the
defaults are Megatron's; `megatron_train.arguments` builds the command-line parser from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


def _help(text: str, **extra: object) -> dict:
    return {"help": text, **extra}


@dataclass
class TrainingConfig:
    """Batch sizes, run length, evaluation cadence, precision, data-parallel wrapper and exit conditions."""

    micro_batch_size: int = field(default=1, metadata=_help("Samples per forward/backward on one rank."))
    global_batch_size: int | None = field(
        default=None,
        metadata=_help("Samples per optimizer step over all data-parallel ranks; default micro-batch * DP."),
    )
    rampup_batch_size: list[int] | None = field(
        default=None,
        metadata=_help(
            "Ramp the global batch size up: <start batch size> <increment> <ramp-up samples>.", nargs=3
        ),
    )
    train_iters: int | None = field(default=None, metadata=_help("Optimizer steps to train for."))
    train_samples: int | None = field(
        default=None, metadata=_help("Samples to train for (use instead of --train-iters).")
    )
    eval_interval: int = field(default=1000, metadata=_help("Evaluate on the validation set every N steps."))
    eval_iters: int = field(default=100, metadata=_help("Validation micro-batch rounds per evaluation."))
    skip_train: bool = field(default=False, metadata=_help("Only evaluate: no training steps."))
    seed: int = field(
        default=1234, metadata=_help("Seed of python, numpy, torch and the model-parallel RNG.")
    )
    use_cpu_initialization: bool = field(
        default=False,
        metadata=_help(
            "Draw each weight in full on the CPU from its own stream of --seed (one per layer), each rank keeping "
            "its slice: every TP/PP/DP layout starts from the same model."
        ),
    )
    accumulate_allreduce_grads_in_fp32: bool = field(
        default=False, metadata=_help("Accumulate and all-reduce grads in fp32 (always on with --bf16).")
    )
    ddp_impl: Literal["local", "torch"] = field(
        default="local", metadata=_help("Data-parallel wrapper: ours (contiguous buffer) or torch's DDP.")
    )
    overlap_grad_reduce: bool = field(
        default=False, metadata=_help("All-reduce grad buckets during backward as they fill (local DDP).")
    )
    ddp_bucket_size: int | None = field(
        default=None, metadata=_help("Elements per grad all-reduce bucket; default max(40M, 1M * DP).")
    )
    exit_interval: int | None = field(
        default=None, metadata=_help("Save (if --save) and exit when the iteration is a multiple of N.")
    )
    exit_duration_in_mins: float | None = field(
        default=None, metadata=_help("Save (if --save) and exit after this many minutes of training.")
    )
    exit_signal_handler: bool = field(
        default=False, metadata=_help("On SIGTERM: finish the step, save (if --save) and exit.")
    )
    distributed_timeout_minutes: int = field(
        default=10, metadata=_help("Timeout of collectives and process-group creation.")
    )
    step_batch_size_schedule: list[str] | None = field(
        default=None,
        metadata=_help(
            "Step-wise global batch size, THRESHOLD:BS THRESHOLD:BS ... with thresholds in tokens "
            "(K/M/B/T suffixes), e.g. 0:16 2.4B:320; the first threshold is 0. One quoted string or "
            "several words (Megatron's GPT-3 example passes it unquoted)."
        ),
    )
    calculate_per_token_loss: bool = field(
        default=False,
        metadata=_help("Loss = sum of token losses / unmasked tokens over all micro-batches and DP ranks."),
    )
    grad_reduce_in_bf16: bool = field(
        default=False, metadata=_help("With --bf16: accumulate and reduce grads in bf16, not fp32.")
    )
    overlap_param_gather: bool = field(
        default=False,
        metadata=_help(
            "Distributed optimizer: all-gather updated params asynchronously, wait at next forward."
        ),
    )
    empty_unused_memory_level: Literal[0, 1, 2] = field(
        default=0,
        metadata=_help(
            "torch.cuda.empty_cache() after each step (1: after the forward-backward, 2: also after "
            "the optimizer step and evaluation); nothing on CPU."
        ),
    )
    manual_gc: bool = field(
        default=False, metadata=_help("Disable automatic garbage collection; collect at chosen points only.")
    )
    manual_gc_interval: int = field(
        default=0, metadata=_help("With --manual-gc: collect every N steps (0: only around evaluation).")
    )
    manual_gc_eval: bool = field(
        default=True, metadata=_help("With --manual-gc: collect before and after each evaluation.")
    )


@dataclass
class OptimizerConfig:
    """AdamW/SGD, learning-rate and weight-decay schedules, gradient clipping and fp16 loss scaling."""

    optimizer: Literal["adam", "sgd"] = field(
        default="adam", metadata=_help("adam is AdamW (decoupled decay).")
    )
    lr: float | None = field(default=None, metadata=_help("Peak learning rate (after warmup)."))
    min_lr: float = field(default=0.0, metadata=_help("Learning rate floor of the decay."))
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = field(
        default="linear", metadata=_help("Shape of the learning-rate decay after warmup.")
    )
    lr_decay_iters: int | None = field(
        default=None, metadata=_help("Decay over N steps; default --train-iters.")
    )
    lr_decay_samples: int | None = field(
        default=None, metadata=_help("Decay over N samples; default --train-samples.")
    )
    lr_warmup_fraction: float | None = field(
        default=None, metadata=_help("Warm up over this fraction of the decay steps.")
    )
    lr_warmup_iters: int = field(default=0, metadata=_help("Warm up linearly over N steps."))
    lr_warmup_samples: int = field(default=0, metadata=_help("Warm up linearly over N samples."))
    lr_warmup_init: float = field(default=0.0, metadata=_help("Learning rate at the start of warmup."))
    weight_decay: float = field(default=0.01, metadata=_help("Decoupled weight decay (not on biases/norms)."))
    start_weight_decay: float | None = field(default=None, metadata=_help("Weight decay at step 0."))
    end_weight_decay: float | None = field(
        default=None, metadata=_help("Weight decay at the end of the run.")
    )
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = field(
        default="constant", metadata=_help("How weight decay moves from start to end.")
    )
    clip_grad: float = field(default=1.0, metadata=_help("Clip the global grad L2 norm to this (0: off)."))
    log_num_zeros_in_grad: bool = field(
        default=False,
        metadata=_help(
            "Count the zero entries of the whole model's gradient each step; logged as 'num zeros'."
        ),
    )
    adam_beta1: float = field(default=0.9, metadata=_help("Adam beta1."))
    adam_beta2: float = field(default=0.999, metadata=_help("Adam beta2."))
    adam_eps: float = field(default=1e-08, metadata=_help("Adam epsilon."))
    sgd_momentum: float = field(default=0.9, metadata=_help("SGD momentum."))
    loss_scale: float | None = field(
        default=None, metadata=_help("Static fp16 loss scale; default: dynamic loss scaling.")
    )
    initial_loss_scale: float = field(default=2.0**32, metadata=_help("Initial dynamic loss scale."))
    min_loss_scale: float = field(default=1.0, metadata=_help("Dynamic loss scale floor."))
    loss_scale_window: int = field(default=1000, metadata=_help("Clean steps before the loss scale doubles."))
    hysteresis: int = field(default=2, metadata=_help("Overflowing steps tolerated before the scale halves."))
    override_opt_param_scheduler: bool = field(
        default=False, metadata=_help("Use this run's schedule settings, not the checkpoint's.")
    )
    use_checkpoint_opt_param_scheduler: bool = field(
        default=False, metadata=_help("Use the checkpoint's schedule settings, ignoring this run's.")
    )
    decoupled_lr: float | None = field(
        default=None, metadata=_help("Peak learning rate of the input embedding and output layer only.")
    )
    decoupled_min_lr: float | None = field(
        default=None, metadata=_help("Learning-rate floor of the input embedding and output layer.")
    )


@dataclass
class CheckpointConfig:
    """Where checkpoints go, how often, and what to load back."""

    save: str | None = field(default=None, metadata=_help("Directory to save checkpoints in."))
    save_interval: int | None = field(default=None, metadata=_help("Save every N steps."))
    no_save_optim: bool = field(default=False, metadata=_help("Do not save optimizer state."))
    no_save_rng: bool = field(default=False, metadata=_help("Do not save RNG states."))
    load: str | None = field(default=None, metadata=_help("Directory to resume from (its latest iteration)."))
    ckpt_step: int | None = field(default=None, metadata=_help("Load this iteration instead of the latest."))
    no_load_optim: bool = field(default=False, metadata=_help("Do not load optimizer state."))
    no_load_rng: bool = field(default=False, metadata=_help("Do not load RNG states."))
    finetune: bool = field(
        default=False,
        metadata=_help("Load weights only; reset iteration and consumed samples, skip optimizer and RNG."),
    )
    use_checkpoint_args: bool = field(
        default=False,
        metadata=_help(
            "Take the model's architecture and tokenizer flags not given on the command line from the checkpoint "
            "in --load (Megatron's); the generation and evaluation tools always do."
        ),
    )
    exit_on_missing_checkpoint: bool = field(
        default=False,
        metadata=_help("With --load: fail instead of starting from scratch when nothing is there."),
    )
    ckpt_format: Literal["torch", "torch_dist"] | None = field(
        default=None,
        metadata=_help(
            "Save format: by default ours (safetensors run directory); torch_dist: Megatron-Core's distributed "
            "checkpoint (PyTorch DCP, every rank writing its own shards); torch: Megatron's name of its legacy "
            "files, saved here in our format (checkpoint_util --saver megatron writes them). --load detects the "
            "format it is given."
        ),
    )
    ckpt_fully_parallel_save: bool = field(
        default=True,
        metadata={
            **_help("torch_dist: spread the writes of replicated tensors over the data-parallel ranks."),
            "opposite_flag": "--ckpt-fully-parallel-save",
        },
    )
    ckpt_fully_parallel_load: bool = field(
        default=False,
        metadata=_help("torch_dist: accepted; every rank always reads only the chunks it holds."),
    )
    async_save: bool = field(
        default=False,
        metadata=_help(
            "torch_dist: write checkpoints in the background while training goes on; the hashes and the latest "
            "marker are written once every rank's part is on disk."
        ),
    )
    non_persistent_save_interval: int | None = field(
        default=None,
        metadata=_help("Also save every N steps to a non-persistent folder that keeps only the newest ones."),
    )
    non_persistent_ckpt_type: Literal["global", "local", "in_memory"] | None = field(
        default=None,
        metadata=_help(
            "Non-persistent checkpoints: global (a run directory; the default with the interval)."
        ),
    )
    non_persistent_global_ckpt_dir: str | None = field(
        default=None,
        metadata=_help("Where global non-persistent checkpoints go; default <save>/non_persistent."),
    )
    dist_ckpt_strictness: Literal[
        "assume_ok_unexpected",
        "log_unexpected",
        "log_all",
        "raise_unexpected",
        "raise_all",
        "return_unexpected",
        "return_all",
        "ignore_all",
    ] = field(
        default="assume_ok_unexpected",
        metadata=_help(
            "torch_dist load: what a key mismatch does (Megatron's StrictHandling; return_* log here, no caller "
            "takes the keys)."
        ),
    )


@dataclass
class LoggingConfig:
    """Console, TensorBoard and metrics-file logging."""

    log_interval: int = field(default=100, metadata=_help("Print and record metrics every N steps."))
    tensorboard_dir: str | None = field(default=None, metadata=_help("Write TensorBoard events here."))
    tensorboard_log_interval: int = field(
        default=1, metadata=_help("Write TensorBoard scalars every N steps.")
    )
    metrics_file: str | None = field(
        default=None,
        metadata=_help("JSON Lines metrics file; default <save>/metrics.jsonl when --save is set."),
    )
    peak_flops: float | None = field(
        default=None, metadata=_help("Peak TFLOP/s of one device, for MFU; default from the GPU's name.")
    )
    log_params_norm: bool = field(
        default=False, metadata=_help("Log the L2 norm of the whole model's parameters ('params norm').")
    )
    log_throughput: bool = field(
        default=False, metadata=_help("Log TFLOP/s per GPU (always on here: every line has the field).")
    )
    profile: bool = field(
        default=False,
        metadata=_help("Record a torch profiler trace of steps --profile-step-start to --profile-step-end."),
    )
    profile_step_start: int = field(default=10, metadata=_help("First profiled step (global step)."))
    profile_step_end: int = field(default=12, metadata=_help("Step at which profiling stops."))
    profile_ranks: list[int] = field(
        default_factory=lambda: [0], metadata=_help("Global ranks that record a profiler trace.")
    )
    profile_dir: str | None = field(
        default=None,
        metadata=_help("Where traces go; default --tensorboard-dir, else <save>/profile, else ./profile."),
    )
    use_pytorch_profiler: bool = field(
        default=False, metadata=_help("Use torch's profiler (always the profiler here: no nsys).")
    )
    moe_per_layer_logging: bool = field(
        default=False,
        metadata=_help(
            "Write each MoE layer's losses and per-expert token counts to TensorBoard and metrics."
        ),
    )
    wandb_project: str | None = field(
        default=None, metadata=_help("Also log metrics to this Weights & Biases project (needs wandb).")
    )
    wandb_exp_name: str | None = field(default=None, metadata=_help("Weights & Biases run name."))
    wandb_save_dir: str | None = field(
        default=None, metadata=_help("Local wandb directory; default <save>/wandb.")
    )


@dataclass
class TokenizerConfig:
    """Megatron's tokenizer flags (the tokenizer itself lives in megatron_train.tokenizer)."""

    tokenizer_type: str | None = field(default=None, metadata=_help("GPT2BPETokenizer, NullTokenizer, ..."))
    vocab_file: str | None = field(default=None, metadata=_help("Vocabulary file of the tokenizer."))
    merge_file: str | None = field(default=None, metadata=_help("BPE merge file."))
    tokenizer_model: str | None = field(default=None, metadata=_help("SentencePiece / HF tokenizer model."))
    vocab_size: int | None = field(default=None, metadata=_help("Vocabulary size of NullTokenizer."))
    vocab_extra_ids: int = field(default=0, metadata=_help("Extra sentinel tokens (T5)."))
    make_vocab_size_divisible_by: int = field(
        default=128, metadata=_help("Pad the vocabulary to a multiple of this (times TP size).")
    )
    tiktoken_pattern: Literal["v1", "v2"] | None = field(
        default=None,
        metadata=_help("TikTokenizer's pre-tokenisation regex: v1 (GPT-2 style) or v2 (cl100k)."),
    )
    tiktoken_num_special_tokens: int = field(
        default=1000, metadata=_help("TikTokenizer: ids reserved for special tokens before the BPE ranks.")
    )


@dataclass
class CompatibilityConfig:
    """Megatron flags that pick a GPU kernel, an implementation or a format this engine does not switch.

    Accepted where they change nothing here (one log line each says what they mean here); refused with the
    flag's name where they would need what this machine or engine lacks (FP8).
    """

    use_mcore_models: bool = field(
        default=False, metadata=_help("Megatron-Core models (the only ones here).")
    )
    transformer_impl: Literal["local", "transformer_engine"] = field(
        default="transformer_engine", metadata=_help("Layer implementation; here always torch modules.")
    )
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = field(
        default="auto",
        metadata=_help("Attention kernel; here torch SDPA (flash-attn with --use-flash-attn)."),
    )
    distributed_backend: Literal["nccl", "gloo"] = field(
        default="nccl", metadata=_help("Collectives backend; here nccl on CUDA, gloo on CPU.")
    )
    masked_softmax_fusion: bool = field(default=True, metadata=_help("Fused masked softmax kernel."))
    cross_entropy_loss_fusion: bool = field(default=False, metadata=_help("Fused cross-entropy kernel."))
    create_attention_mask_in_dataloader: bool = field(
        default=True, metadata=_help("Build attention masks in the data loader (never needed here).")
    )
    mmap_bin_files: bool = field(default=True, metadata=_help("Memory-map .bin files (always here)."))
    spec: list[str] | None = field(
        default=None,
        metadata={
            "help": "Megatron-Core's module spec (`<module> <function>`); here the family builds its own layers.",
            "nargs": "*",
        },
    )
    dataset_impl: Literal["mmap"] | None = field(
        default=None,
        metadata=_help("Megatron's old .bin/.idx format choice; mmap, the only format here, is accepted."),
    )
    data_parallel_sharding_strategy: (
        Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] | None
    ) = field(default=None, metadata=_help("Megatron-FSDP's sharding (--use-megatron-fsdp, not built here)."))
    fp8_format: Literal["e4m3", "hybrid"] | None = field(
        default=None, metadata=_help("FP8 training (needs Transformer Engine and an FP8 GPU).")
    )
    fp8_amax_history_len: int = field(default=1, metadata=_help("FP8 amax history length."))
    fp8_amax_compute_algo: Literal["most_recent", "max"] = field(
        default="most_recent", metadata=_help("FP8 amax reduction.")
    )
    fp8_param_gather: bool = field(default=False, metadata=_help("Keep and all-gather params in FP8."))
    moe_permute_fusion: bool = field(default=False, metadata=_help("Fused MoE token permutation kernels."))
    moe_router_fusion: bool = field(default=False, metadata=_help("Fused MoE router kernels."))
    moe_enable_deepep: bool = field(
        default=False, metadata=_help("DeepEP's fused all-to-all (needs DeepEP on GPUs; refused here).")
    )
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep"] | None = field(
        default=None, metadata=_help("The flex dispatcher's kernels (DeepEP / HybridEP; refused here).")
    )
