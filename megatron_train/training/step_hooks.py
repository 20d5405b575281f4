"""Side jobs around training steps that Megatron's flags ask for: a torch profiler trace of a step window
(--profile), manual garbage collection (--manual-gc), emptying the CUDA cache (--empty-unused-memory-level).

The loop calls `StepHooks` at fixed points (start of a step, after forward-backward, after the optimizer step,
around evaluation, end of training), so each flag's timing matches Megatron's `train` (docs/architecture.md).
"""

from __future__ import annotations

import gc
import logging
import os

import torch
import torch.distributed as dist

from megatron_train.arguments import MegatronConfig

logger = logging.getLogger(__name__)


def profile_dir(config: MegatronConfig) -> str:
    """Where --profile writes traces: --profile-dir, else --tensorboard-dir (as Megatron), else <save>/profile."""
    logging_config = config.logging
    if logging_config.profile_dir:
        return logging_config.profile_dir
    if logging_config.tensorboard_dir:
        return logging_config.tensorboard_dir
    return os.path.join(config.checkpoint.save or ".", "profile")


class StepHooks:
    """One object per run; every method is cheap when its flag is off."""

    def __init__(self, config: MegatronConfig) -> None:
        self.training = config.training
        self.logging = config.logging
        self.trace_dir = profile_dir(config)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank = rank
        self.profiler: torch.profiler.profile | None = None
        self.profiles = self.logging.profile and rank in self.logging.profile_ranks
        self.empties_cache = self.training.empty_unused_memory_level > 0 and torch.cuda.is_available()
        if self.training.empty_unused_memory_level > 0 and not self.empties_cache and rank == 0:
            logger.info(
                "--empty-unused-memory-level %d: no CUDA device, so there is no cache to empty",
                self.training.empty_unused_memory_level,
            )

    def start_training(self) -> None:
        """Megatron's --manual-gc: collect once, then only where the hooks below say."""
        if self.training.manual_gc:
            gc.disable()
            gc.collect()

    def before_step(self, iteration: int) -> None:
        """`iteration` steps are done; the profiler records steps profile_step_start + 1 .. profile_step_end."""
        if self.profiles and iteration == self.logging.profile_step_start and self.profiler is None:
            os.makedirs(self.trace_dir, exist_ok=True)
            self.profiler = torch.profiler.profile(
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    self.trace_dir, worker_name=f"rank{self.rank}"
                ),
                record_shapes=True,
            )
            self.profiler.start()
        if iteration == self.logging.profile_step_end:
            self._stop_profiler()

    def after_forward_backward(self) -> None:
        if self.empties_cache:
            torch.cuda.empty_cache()

    def after_step(self, iteration: int) -> None:
        if self.empties_cache and self.training.empty_unused_memory_level >= 2:
            torch.cuda.empty_cache()
        if self.profiler is not None:
            self.profiler.step()
        interval = self.training.manual_gc_interval
        if self.training.manual_gc and interval and iteration % interval == 0:
            gc.collect()

    def around_evaluation(self) -> None:
        """Called before and after each evaluation."""
        if self.training.manual_gc and self.training.manual_gc_eval:
            gc.collect()
        if self.empties_cache:
            torch.cuda.empty_cache()

    def end_training(self) -> None:
        self._stop_profiler()
        if self.training.manual_gc:
            gc.enable()

    def _stop_profiler(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()  # writes <trace_dir>/rank<r>.<time>.pt.trace.json
            self.profiler = None
            logger.info("--profile: wrote the trace of the profiled steps to %s", self.trace_dir)
