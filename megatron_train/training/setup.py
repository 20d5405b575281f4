"""Start-up of a training run: process groups, seeds, model + DDP + optimizer + scheduler, data iterators."""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import TrainingProgress, load_checkpoint
from megatron_train.checkpointing.names import model_type
from megatron_train.convert.detect import open_megatron_lm_checkpoint
from megatron_train.data.samplers import build_pretraining_data_loader
from megatron_train.device import get_backend, set_device_for_local_rank
from megatron_train.distributed import DDPConfig, wrap_data_parallel
from megatron_train.families.family import ModelProvider
from megatron_train.optimizer import MegatronOptimizer, get_megatron_optimizer
from megatron_train.parallel import model_parallel_seed, state
from megatron_train.parallel.param_init import materialize
from megatron_train.parallel.tied_embeddings import sync_embedding_weights
from megatron_train.training.lr_scheduler import OptimizerParamScheduler, build_opt_param_scheduler
from megatron_train.training.microbatches import MicroBatchCalculator, parse_step_batch_size_schedule

DatasetsProvider = Callable[[tuple[int, int, int]], tuple[Any, Any, Any]]


def initialize_distributed(timeout_minutes: int) -> bool:
    """Join the process group torchrun describes (or a one-rank group); True when this call created it."""
    if dist.is_initialized():
        return False
    set_device_for_local_rank()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ:
        dist.init_process_group(get_backend(), timeout=timeout)
        return True
    # A plain `python -m ...` (or a tool called in-process): a group of one on a free port, passed to this
    # call only; setting RANK / MASTER_PORT in the environment would hand that port to every process it starts.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(
        get_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout
    )
    return True


@contextlib.contextmanager
def model_parallel_session(
    config: MegatronConfig, pipeline_size: int, virtual_pipeline_size: int | None
) -> Iterator[None]:
    """A run's process group (joined, or created here and destroyed at the end) and model-parallel groups
    (--tensor-model-parallel-size x --context-parallel-size x `pipeline_size`), torn down when the run ends, also on an error."""
    created_group = initialize_distributed(config.training.distributed_timeout_minutes)
    parallel = config.parallel
    state.initialize_model_parallel(
        parallel.tensor_model_parallel_size,
        pipeline_size,
        virtual_pipeline_size,
        parallel.context_parallel_size,
        parallel.expert_model_parallel_size,
        parallel.expert_tensor_size,
    )
    try:
        yield
    finally:
        state.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()


def set_random_seed(seed: int) -> None:
    """Megatron's seeding: offset by the pipeline rank, same on TP and DP ranks; model-parallel RNG per TP rank."""
    seed = seed + 100 * state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    model_parallel_seed(seed)


@dataclass
class TrainingSetup:
    """Everything the loop needs, built in Megatron's order.

    `model` holds this rank's model chunks, each in its data-parallel wrapper: one chunk, or one per virtual
    pipeline stage under the interleaved schedule (chunk c of pipeline rank r is virtual stage c * PP + r).
    """

    model: list[torch.nn.Module]
    unwrapped_model: list[torch.nn.Module]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    calculator: MicroBatchCalculator
    train_iters: int
    loaded: TrainingProgress


def build_model_chunks(
    config: MegatronConfig, model_provider: ModelProvider, padded_vocab_size: int, device: torch.device
) -> list[torch.nn.Module]:
    """This rank's pipeline stage, one chunk per virtual stage, tied embedding copies made equal.

    Built on the meta device and materialised on `device`, each parameter drawing only this rank's shard
    (`parallel.param_init`); under --use-cpu-initialization built on the CPU from the full weights and moved."""
    on_meta = not config.training.use_cpu_initialization
    chunks = []
    for vp_stage in range(state.get_virtual_pipeline_model_parallel_world_size() or 1):
        pre_process, post_process = (
            state.is_pipeline_first_stage(vp_stage),
            state.is_pipeline_last_stage(vp_stage),
        )
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            chunk = model_provider(config, padded_vocab_size, pre_process, post_process, vp_stage)
        chunks.append(materialize(chunk, device) if on_meta else chunk.to(device))
    sync_embedding_weights(chunks)
    return chunks


def print_parameter_count(chunks: list[torch.nn.Module]) -> None:
    """Megatron's line of how many parameters this rank's model chunks hold, from data-parallel rank 0."""
    if state.get_data_parallel_rank(with_context_parallel=True) == 0:
        print(
            " > number of parameters on (tensor, pipeline) model parallel rank "
            f"({state.get_tensor_model_parallel_rank()}, {state.get_pipeline_model_parallel_rank()}): "
            f"{sum(p.numel() for chunk in chunks for p in chunk.parameters())}",
            flush=True,
        )


def microbatch_calculator(config: MegatronConfig, data_parallel_size: int) -> MicroBatchCalculator:
    """The run's global and micro batch sizes per step (ramp-up and step schedule included)."""
    training = config.training
    return MicroBatchCalculator(
        training.global_batch_size,
        training.micro_batch_size,
        data_parallel_size,
        training.rampup_batch_size,
        parse_step_batch_size_schedule(training.step_batch_size_schedule, config.model.seq_length)
        if training.step_batch_size_schedule
        else None,
    )


def planned_train_iters(config: MegatronConfig, calculator: MicroBatchCalculator) -> int:
    """--train-iters, or the steps that consume --train-samples."""
    training = config.training
    if training.train_iters is not None:
        return training.train_iters
    return calculator.train_iters_for_samples(training.train_samples or 0)


def split_sample_counts(config: MegatronConfig, train_iters: int) -> tuple[int, int, int]:
    """Megatron's sample budget per split: the train samples, --eval-iters global batches at every
    --eval-interval and once at the end (valid), and once more (test)."""
    training = config.training
    gbs = training.global_batch_size
    evaluations = train_iters // training.eval_interval + 1 if training.eval_interval else 1
    return (
        training.train_samples or train_iters * gbs,
        evaluations * training.eval_iters * gbs,
        training.eval_iters * gbs,
    )


def planned_sample_counts(config: MegatronConfig, world_size: int) -> tuple[int, int, int]:
    """The (train, valid, test) samples a run of `world_size` processes will read, known before it launches."""
    calculator = microbatch_calculator(config, config.parallel.data_parallel_size(world_size))
    return split_sample_counts(config, planned_train_iters(config, calculator))


def setup_model_and_optimizer(
    config: MegatronConfig, model_provider: ModelProvider, padded_vocab_size: int, device: torch.device
) -> TrainingSetup:
    training = config.training
    calculator = microbatch_calculator(config, state.get_data_parallel_world_size())
    train_iters = planned_train_iters(config, calculator)
    unwrapped = build_model_chunks(config, model_provider, padded_vocab_size, device)
    print_parameter_count(unwrapped)
    model, optimizer = wrap_and_optimize(config, unwrapped)
    scheduler = build_opt_param_scheduler(
        optimizer.optimizer,
        config.optimizer,
        training.train_iters,
        training.train_samples,
        training.global_batch_size,
    )
    loaded = TrainingProgress()
    if (
        config.checkpoint.load
    ):  # ours (safetensors or torch_dist), or a Megatron-LM checkpoint converted in memory
        stage, ckpt = checkpoint_model(unwrapped), config.checkpoint
        saved = open_megatron_lm_checkpoint(ckpt.load, ckpt.ckpt_step, model_type(stage))
        loaded = load_checkpoint(stage, optimizer, scheduler, config, padded_vocab_size, saved)
        sync_embedding_weights(unwrapped)
    return TrainingSetup(model, unwrapped, optimizer, scheduler, calculator, train_iters, loaded)


def wrap_and_optimize(
    config: MegatronConfig, unwrapped: list[torch.nn.Module]
) -> tuple[list[torch.nn.Module], MegatronOptimizer]:
    """The model chunks in their data-parallel wrappers and one optimizer over all of them (params named
    `<chunk>.<name>` for several chunks). Gradients are reduced, and the distributed optimizer shards, over data x
    context parallel (Megatron's); expert gradients over expert data parallel, which holds the CP ranks too."""
    training = config.training
    ddp_config = DDPConfig(
        grad_reduce_in_fp32=training.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=training.overlap_grad_reduce,
        bucket_size=training.ddp_bucket_size,
        use_distributed_optimizer=config.parallel.use_distributed_optimizer,
        overlap_param_gather=training.overlap_param_gather,
    )
    initialized = state.model_parallel_is_initialized()
    dp_group = state.get_data_parallel_group(with_context_parallel=True) if initialized else None
    expert_dp_group = state.get_expert_data_parallel_group() if initialized else None
    model = [
        wrap_data_parallel(chunk, training.ddp_impl, ddp_config, dp_group, expert_dp_group)
        for chunk in unwrapped
    ]
    optimizer = get_megatron_optimizer(
        config.optimizer, model, config.model.params_dtype, config.parallel.use_distributed_optimizer
    )
    return model, optimizer


def checkpoint_model(chunks: list[torch.nn.Module]) -> torch.nn.Module | list[torch.nn.Module]:
    """What save/load_checkpoint take: the stage's module, or Megatron's list of chunks when interleaved."""
    return chunks[0] if len(chunks) == 1 else chunks


def build_data_iterators(
    config: MegatronConfig,
    datasets_provider: DatasetsProvider,
    train_iters: int,
    loaded: TrainingProgress,
    num_chunks: int = 1,
) -> tuple[list[Iterator] | None, list[Iterator] | None, list[Iterator] | None]:
    """Megatron's sample budget per split; train and valid loaders resume at the consumed sample counts.

    Each split gets one iterator per model chunk (the interleaved schedule reads them independently), or None
    when the split is empty. Every pipeline stage reads the data: the first takes the tokens, the last the
    labels and loss mask, and every stage the position ids (rotary embeddings need them, and
    --reset-position-ids makes them depend on the documents).
    """
    num_samples = split_sample_counts(config, train_iters)
    consumed = (loaded.consumed_train_samples, loaded.consumed_valid_samples, 0)
    with preserve_rng_state():  # a resumed run restored its RNG already; building data must not move it
        datasets = datasets_provider(num_samples)
        iterators = [
            _chunk_iterators(config, dataset, samples, num_chunks)
            for dataset, samples in zip(datasets, consumed, strict=True)
        ]
    return iterators[0], iterators[1], iterators[2]


@contextlib.contextmanager
def preserve_rng_state() -> Iterator[None]:
    """Run the block without changing python's, numpy's or torch's (CPU and CUDA) global RNG state."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)


def _chunk_iterators(
    config: MegatronConfig, dataset: Any, consumed_samples: int, num_chunks: int
) -> list[Iterator] | None:
    if dataset is None or len(dataset) == 0:
        return None
    return [
        iter(
            build_pretraining_data_loader(
                dataset,
                consumed_samples,
                config.training.micro_batch_size,
                state.get_data_parallel_rank(),
                state.get_data_parallel_world_size(),
                num_workers=config.data.num_workers,
            )
        )
        for _ in range(num_chunks)
    ]
