"""Megatron's training loop: `pretrain` sets up, `train` runs steps with logging, evaluation, checkpoints
and exit conditions, `train_step` is one optimizer step over several micro-batches, `evaluate` validates.

Every step, with or without pipeline parallelism, goes through `get_forward_backward_func()` (no pipelining,
1F1B or interleaved 1F1B); the loss exists on the last pipeline stage, which holds the last rank that logs."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import TrainingProgress, save_checkpoint
from megatron_train.checkpointing.dist_checkpoint import wait_for_async_save
from megatron_train.checkpointing.load import non_persistent_dir
from megatron_train.checkpointing.save import prune_non_persistent
from megatron_train.device import get_device
from megatron_train.distributed import finalize_model_grads
from megatron_train.models.moe.aux_losses import METRICS, set_backward_scale
from megatron_train.models.moe.config import AUX_LOSS_NAMES
from megatron_train.models.terms import ModelTerms
from megatron_train.optimizer.clip_grads import params_l2_norm
from megatron_train.parallel import state
from megatron_train.parallel.schedules import ForwardStepFunc, get_forward_backward_func
from megatron_train.training.flops import peak_flops_per_device
from megatron_train.training.logging import (
    MetricsWriter,
    format_evaluation_line,
    format_training_line,
    peak_memory_mb,
)
from megatron_train.training.per_token_loss import NUM_TOKENS_KEY, scale_grads_to_per_token_loss
from megatron_train.training.setup import (
    DatasetsProvider,
    ModelProvider,
    TrainingSetup,
    build_data_iterators,
    checkpoint_model,
    model_parallel_session,
    set_random_seed,
    setup_model_and_optimizer,
)
from megatron_train.training.signals import DistributedSignalHandler
from megatron_train.training.step_hooks import StepHooks
from megatron_train.training.wandb_writer import build_wandb_writer


def get_batch(data_iterator: Iterator, device: torch.device) -> dict[str, torch.Tensor]:
    batch = next(data_iterator)
    return {key: torch.as_tensor(value).to(device, non_blocking=True) for key, value in batch.items()}


def average_across_data_parallel(value: torch.Tensor) -> torch.Tensor:
    if state.get_data_parallel_world_size() > 1:
        dist.all_reduce(value, group=state.get_data_parallel_group())
        value /= state.get_data_parallel_world_size()
    return value


def average_losses(reduced: list[dict[str, torch.Tensor]]) -> dict[str, float] | None:
    """Every entry of loss_func's dicts (`lm loss`, BERT's `sop loss`, MoE's aux losses) averaged over the
    micro-batches and data-parallel ranks, on the last pipeline stage (where the schedule computed them;
    Megatron logs from there); None on the other stages. With --calculate-per-token-loss (the entries are loss
    sums, with token counts under NUM_TOKENS_KEY) each loss is its sum over all tokens over their number."""
    if not state.is_pipeline_last_stage():
        return None
    if NUM_TOKENS_KEY in reduced[0]:
        keys = [key for key in reduced[0] if key != NUM_TOKENS_KEY]
        sums = torch.stack(
            [torch.stack([entry[key].double() for entry in reduced]).sum() for key in [*keys, NUM_TOKENS_KEY]]
        )
        sums = average_across_data_parallel(sums)  # the DP mean of sums: the ratios are those of the sums
        return {key: (sums[i] / sums[-1].clamp(min=1.0)).item() for i, key in enumerate(keys)}
    keys = list(reduced[0])
    means = torch.stack([torch.stack([entry[key].float() for entry in reduced]).mean() for key in keys])
    return dict(zip(keys, average_across_data_parallel(means).tolist(), strict=True))


def train_step(
    forward_step_func: ForwardStepFunc,
    data_iterators: list[Iterator],
    setup: TrainingSetup,
    config: MegatronConfig,
    hooks: StepHooks | None = None,
) -> tuple[dict[str, float] | None, bool, float | None, float | None]:
    """One global batch through the pipeline schedule, then Megatron's grad finalisation and optimizer step.

    Returns (the losses averaged over micro-batches and DP ranks, None off the last pipeline stage; an MoE
    model's auxiliary losses are among them, under Megatron's names, and with --moe-per-layer-logging each layer's
    as `moe/...` entries; skipped (fp16 overflow); grad norm over the whole model; zeros in the whole model's grad
    with --log-num-zeros-in-grad, else None).
    """
    optimizer = setup.optimizer
    for chunk in setup.model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss_scale = optimizer.get_loss_scale()
    num_micro_batches = setup.calculator.num_micro_batches
    if config.model.is_moe:  # the routers' losses get the gradient scale of the LM loss, which each CP rank
        # multiplies by the CP size (training/per_token_loss.py; Megatron's schedules scale the aux losses so too)
        cp_size = state.get_context_parallel_world_size()
        set_backward_scale(loss_scale * cp_size / num_micro_batches, config.training.calculate_per_token_loss)
    reduced = get_forward_backward_func()(
        forward_step_func,
        data_iterators,
        setup.model,
        num_micro_batches,
        config.model.seq_length,
        config.training.micro_batch_size,
        sequence_parallel=config.parallel.sequence_parallel,
        grad_scale_func=lambda loss: loss * loss_scale,
        overlap_p2p_comm=config.parallel.overlap_p2p_comm,
    )
    if hooks is not None:
        hooks.after_forward_backward()
    finalize_model_grads(setup.model)
    if config.training.calculate_per_token_loss:
        scale_grads_to_per_token_loss(setup.model, reduced, setup.calculator.num_micro_batches)
    update_successful, grad_norm, num_zeros = optimizer.step()
    if update_successful:
        setup.scheduler.step(increment=setup.calculator.current_global_batch_size)
    losses = average_losses(reduced)
    if config.model.is_moe:
        moe_losses, per_layer = METRICS.report(
            num_micro_batches, sum(config.model.moe_layer_pattern), state.process_groups()
        )
        if losses is not None:
            losses.update(moe_losses)
            if config.logging.moe_per_layer_logging:
                losses.update(per_layer)
    return losses, not update_successful, grad_norm, num_zeros


@torch.no_grad()
def evaluate(
    forward_step_func: ForwardStepFunc,
    data_iterators: list[Iterator],
    model: list[torch.nn.Module],
    eval_iters: int,
    num_micro: int,
    config: MegatronConfig,
) -> dict[str, float] | None:
    """Mean losses over `eval_iters` global batches run forward-only through the pipeline schedule, averaged
    over DP ranks (None off the last pipeline stage); the model goes back to train mode."""
    for chunk in model:
        chunk.eval()
    schedule = get_forward_backward_func()
    reduced = []
    for _ in range(eval_iters):
        reduced += schedule(
            forward_step_func,
            data_iterators,
            model,
            num_micro,
            config.model.seq_length,
            config.training.micro_batch_size,
            forward_only=True,
            sequence_parallel=config.parallel.sequence_parallel,
        )
    for chunk in model:
        chunk.train()
    return average_losses(reduced)


@dataclass
class IntervalStats:
    """What the loop accumulates between two log lines (Megatron's total_loss_dict)."""

    loss_sums: dict[str, float] = field(default_factory=dict)  # per loss_func key, over advanced iterations
    advanced: int = 0
    skipped: int = 0
    nan: int = 0
    iterations: int = 0
    samples: int = 0
    start: float = 0.0

    def add_losses(self, losses: dict[str, float], skipped: bool) -> None:
        """Sum a step's losses, every key logged even when no step advanced (its average is then None); a
        skipped step adds nothing, one with a non-finite loss counts as a nan iteration."""
        for key in losses:
            self.loss_sums.setdefault(key, 0.0)
        if skipped:
            return
        if not all(math.isfinite(loss) for loss in losses.values()):
            self.nan += 1
            return
        for key, loss in losses.items():
            self.loss_sums[key] += loss
        self.advanced += 1


class Trainer:
    """Runs `train` and the evaluations, writes logs, saves checkpoints and decides when to exit."""

    def __init__(
        self,
        config: MegatronConfig,
        setup: TrainingSetup,
        forward_step_func: ForwardStepFunc,
        padded_vocab_size: int,
        terms: ModelTerms,
        writer: MetricsWriter | None,
        sequences_per_sample: int = 1,
    ) -> None:
        """`terms`: the model family's terms of one sequence (`ModelFamily.terms`), for the FLOPs logged;
        `sequences_per_sample`: sequences in one sample (a RACE question's 4 options), for the tokens and FLOPs."""
        self.config = config
        self.terms = terms
        self.sequences_per_sample = sequences_per_sample
        self.setup = setup
        self.forward_step_func = forward_step_func
        self.padded_vocab_size = padded_vocab_size
        self.writer = writer
        self.progress = TrainingProgress(**vars(setup.loaded))
        self.peak_flops = peak_flops_per_device(config.logging.peak_flops)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.last_saved_iteration: int | None = None
        self.hooks = StepHooks(config)
        model = config.model
        if model.is_moe:
            names = [AUX_LOSS_NAMES[kind] for kind in model.aux_loss_coeffs()]
            names += ["z_loss"] if model.moe_z_loss_coeff is not None else []
            METRICS.start(names, model.num_layers, model.num_experts, get_device())

    def save(self, non_persistent: bool = False) -> None:
        """Save this iteration under --save, or `non_persistent`ly (--non-persistent-save-interval: a folder that
        keeps only the newest checkpoints)."""
        root = self.config.checkpoint.save
        if non_persistent:
            root = non_persistent_dir(self.config, root)
            prune_non_persistent(root)
        if root and self.last_saved_iteration != self.progress.iteration:
            for chunk in self.setup.model:  # --overlap-param-gather: params may still be in flight
                chunk.finish_param_sync()
            save_checkpoint(
                self.progress.iteration,
                checkpoint_model(self.setup.unwrapped_model),
                self.setup.optimizer,
                self.setup.scheduler,
                self.progress,
                self.config,
                self.padded_vocab_size,
                root,
            )
            self.last_saved_iteration = self.progress.iteration

    def _log(self, interval: IntervalStats, grad_norm: float | None, num_zeros: float | None) -> None:
        """Megatron's training log line (and metrics record) for the interval; on every rank, since the params
        norm (--log-params-norm) is reduced over the model-parallel group."""
        losses = interval.loss_sums.items()
        seconds = time.perf_counter() - interval.start
        elapsed = seconds / max(interval.iterations, 1)
        gbs = self.setup.calculator.current_global_batch_size
        sequences = interval.samples * self.sequences_per_sample
        flops = self.terms.flops_per_sample() * sequences
        tflops_per_device = flops / seconds / self.world_size / 1e12
        stats = {
            "iteration": self.progress.iteration,
            "consumed samples": self.progress.consumed_train_samples,
            "elapsed time per iteration (ms)": elapsed * 1000.0,
            "throughput per GPU (TFLOP/s/GPU)": tflops_per_device,
            "learning rate": self.setup.optimizer.param_groups[0]["lr"],
            "global batch size": gbs,
            **{key: total / interval.advanced if interval.advanced else None for key, total in losses},
            "loss scale": self.setup.optimizer.get_loss_scale(),
            "grad norm": grad_norm,
            "num zeros": num_zeros,
            "params norm": params_l2_norm(self.setup.model) if self.config.logging.log_params_norm else None,
            "number of skipped iterations": interval.skipped,
            "number of nan iterations": interval.nan,
            "tokens per second": sequences * self.config.model.seq_length / seconds,
            "MFU": tflops_per_device * 1e12 / self.peak_flops if self.peak_flops else None,
            "peak memory (MB)": peak_memory_mb(),
        }
        if _is_logging_rank():
            line_keys = [key for key in interval.loss_sums if not key.startswith("moe/")]  # TensorBoard only
            print(format_training_line(stats, self.setup.train_iters, line_keys), flush=True)
            if self.writer is not None:
                self.writer.write(stats)

    def evaluate_and_log(
        self, data_iterators: list[Iterator], split: str, prefix: str | None = None
    ) -> dict[str, float] | None:
        training = self.config.training
        self.hooks.around_evaluation()
        losses = evaluate(
            self.forward_step_func,
            data_iterators,
            self.setup.model,
            training.eval_iters,
            self.setup.calculator.num_micro_batches,
            self.config,
        )
        self.hooks.around_evaluation()
        if split == "valid":
            self.progress.consumed_valid_samples += (
                training.eval_iters * self.setup.calculator.current_global_batch_size
            )
        if _is_logging_rank():
            line = format_evaluation_line(prefix or f"iteration {self.progress.iteration}", losses)
            print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
            if self.writer is not None:
                self.writer.write(
                    {
                        "iteration": self.progress.iteration,
                        "split": split,
                        "end_of_training": prefix is not None,
                        **losses,
                        **{f"{key} PPL": math.exp(min(20.0, loss)) for key, loss in losses.items()},
                    }
                )
        return losses

    def _should_exit(self, signals: DistributedSignalHandler | None, train_start: float) -> str | None:
        training = self.config.training
        if signals is not None and signals.signals_received():
            return "received SIGTERM"
        if training.exit_duration_in_mins is not None:
            over = torch.tensor(
                [float(time.time() - train_start > 60 * training.exit_duration_in_mins)], device=get_device()
            )
            if dist.is_initialized():
                dist.all_reduce(over, op=dist.ReduceOp.MAX)
            if over.item() > 0:
                return f"exceeded --exit-duration-in-mins {training.exit_duration_in_mins}"
        if _every(self.progress.iteration, training.exit_interval):
            return f"reached --exit-interval {training.exit_interval}"
        return None

    def train(
        self,
        train_iterators: list[Iterator],
        valid_iterators: list[Iterator] | None,
        until: int | None = None,
    ) -> bool:
        """Step until iteration `until` (default --train-iters; finetuning stops at each epoch's end); True when
        an exit condition stopped the run early (after saving)."""
        until = self.setup.train_iters if until is None else until
        training, ckpt = self.config.training, self.config.checkpoint
        interval = IntervalStats(start=time.perf_counter())
        train_start = time.time()
        handler = DistributedSignalHandler() if training.exit_signal_handler else None
        self.hooks.start_training()
        with handler if handler is not None else contextlib.nullcontext(), contextlib.ExitStack() as cleanup:
            cleanup.callback(self.hooks.end_training)
            while self.progress.iteration < until:
                self.hooks.before_step(self.progress.iteration)
                self.setup.calculator.update(self.progress.consumed_train_samples)
                losses, skipped, grad_norm, num_zeros = train_step(
                    self.forward_step_func, train_iterators, self.setup, self.config, self.hooks
                )
                self.progress.iteration += 1
                self.hooks.after_step(self.progress.iteration)
                batch = self.setup.calculator.current_global_batch_size
                self.progress.consumed_train_samples += batch
                interval.iterations += 1
                interval.samples += batch
                interval.skipped += int(skipped)
                if losses is not None:  # the losses exist on the last pipeline stage
                    interval.add_losses(losses, skipped)
                if _every(self.progress.iteration, self.config.logging.log_interval):
                    self._log(interval, grad_norm, num_zeros)
                    interval = IntervalStats(start=time.perf_counter())
                paused = time.perf_counter()  # evaluating and saving do not count as iteration time
                if (
                    valid_iterators is not None
                    and training.eval_iters
                    and _every(self.progress.iteration, training.eval_interval)
                ):
                    self.evaluate_and_log(valid_iterators, "valid")
                if ckpt.save and _every(self.progress.iteration, ckpt.save_interval):
                    self.save()
                elif _every(self.progress.iteration, ckpt.non_persistent_save_interval):
                    self.save(non_persistent=True)
                interval.start += time.perf_counter() - paused
                reason = self._should_exit(handler, train_start)
                if reason is not None:
                    self.save()
                    if _is_logging_rank():
                        print(f"exiting program at iteration {self.progress.iteration}: {reason}", flush=True)
                    return True
        return False


def _every(iteration: int, interval: int | None) -> bool:
    return bool(interval) and iteration % interval == 0


def _is_logging_rank() -> bool:
    """Megatron logs on the last rank (it holds the loss under pipeline parallelism)."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def build_metrics_writer(config: MegatronConfig, loaded_iteration: int) -> MetricsWriter | None:
    """The logging rank's writer (TensorBoard, `metrics.jsonl` in --save by default, W&B); None elsewhere."""
    if not _is_logging_rank():
        return None
    metrics_file = config.logging.metrics_file
    if metrics_file is None and config.checkpoint.save:
        metrics_file = os.path.join(config.checkpoint.save, "metrics.jsonl")
    return MetricsWriter(
        config.logging.tensorboard_dir, metrics_file, loaded_iteration, wandb=build_wandb_writer(config)
    )


def pretrain(
    config: MegatronConfig,
    model_provider: ModelProvider,
    datasets_provider: DatasetsProvider,
    forward_step_func: ForwardStepFunc,
    padded_vocab_size: int,
    terms: ModelTerms,
) -> TrainingProgress:
    """Megatron's `pretrain`: initialise, build model/optimizer/data, train, evaluate valid and test, save.

    `forward_step_func(data_iterator, model) -> (output_tensor, loss_func)` is Megatron's forward step (see
    `parallel.schedules`); `loss_func(output_tensor)` returns `(loss, {name: detached value})`, every entry of which the loop
    averages and logs (`lm loss` for GPT). `terms` are the model's (its family's `terms`), for the FLOPs logged.
    Returns the final iteration and consumed sample counts.
    """
    parallel = config.parallel
    virtual_pipeline_size = parallel.virtual_pipeline_model_parallel_size(config.model.num_layers)
    with model_parallel_session(config, parallel.pipeline_model_parallel_size, virtual_pipeline_size):
        writer = None
        try:
            set_random_seed(config.training.seed)
            setup = setup_model_and_optimizer(config, model_provider, padded_vocab_size, get_device())
            train_iters, valid_iters, test_iters = build_data_iterators(
                config, datasets_provider, setup.train_iters, setup.loaded, num_chunks=len(setup.model)
            )
            writer = build_metrics_writer(config, setup.loaded.iteration)
            trainer = Trainer(config, setup, forward_step_func, padded_vocab_size, terms, writer)
            exited_early = False
            if not config.training.skip_train and train_iters is not None:
                exited_early = trainer.train(train_iters, valid_iters)
                if not exited_early:
                    trainer.save()
            if not exited_early:
                if valid_iters is not None and config.training.eval_iters:
                    trainer.evaluate_and_log(valid_iters, "valid", "the end of training for val data")
                if test_iters is not None and config.training.eval_iters:
                    trainer.evaluate_and_log(test_iters, "test", "the end of training for test data")
            wait_for_async_save()  # the last checkpoint is complete before the run ends
            return trainer.progress
        finally:
            if writer is not None:
                writer.close()
