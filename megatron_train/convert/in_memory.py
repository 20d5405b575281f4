"""A Megatron-LM checkpoint converted in memory and read as one of ours, so `--load` takes it where it is
(pretrain_*, tasks.main, the text generation server; docs/architecture.md, checkpoints).

The converter's loaders (`megatron.open_checkpoint`, `torch_dist.open_checkpoint`) read the whole model; it is then
seen as a TP1 x PP1 checkpoint of ours (`ConvertedCheckpoint`), so every rank of any (TP, PP, DP) layout cuts its
part of it as it does from our files, the vocabulary re-padded for its TP size. Training progress (iteration,
consumed samples, the LR scheduler) comes from the checkpoint; Adam's state where it maps (`megatron_optimizer`;
otherwise loading it is refused unless --no-load-optim or --finetune); RNG states never (Megatron's per-rank
streams do not carry over: as --no-load-rng). Every rank reads the whole checkpoint: for a model too large for
that, convert it once with `tools/checkpoint_util` and load the result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from megatron_train.arguments import config_to_dict
from megatron_train.checkpointing.files import CheckpointError
from megatron_train.checkpointing.layout import ExpertLayout, module_order, true_vocab_range
from megatron_train.checkpointing.names import sharding_record
from megatron_train.checkpointing.saved import SavedCheckpoint
from megatron_train.convert.megatron import LegacyCheckpoint
from megatron_train.convert.megatron_optimizer import (
    UnmappedOptimizerState,
    dist_optimizer_state,
    legacy_optimizer_state,
)
from megatron_train.convert.torch_dist import DistCheckpoint
from megatron_train.convert.weights import ModelWeights, expert_names, model_shardings
from megatron_train.families.family import ModelFamily

logger = logging.getLogger(__name__)

# What our scheduler's `load_state_dict` reads: Megatron's OptimizerParamScheduler.state_dict has the same keys.
SCHEDULER_KEYS = (
    "max_lr",
    "lr_warmup_steps",
    "num_steps",
    "lr_decay_style",
    "lr_decay_steps",
    "min_lr",
    "start_wd",
    "end_wd",
    "wd_incr_style",
    "wd_incr_steps",
)


OptimizerState = tuple[dict[str, torch.Tensor], dict]  # what `MegatronOptimizer.state_dict` returns


class ConvertedCheckpoint(SavedCheckpoint):
    """Another format's checkpoint read through the converter's loaders: its whole model (the vocabulary padded
    as saved), its optimizer state where it maps, and its training progress, read as `SavedCheckpoint` reads ours.
    `iteration_dir` is the source's iteration folder (error messages name it). `read_optimizer` maps the
    optimizer state when a run first asks for it (a --finetune or --no-load-optim run never reads it)."""

    def __init__(
        self,
        weights: ModelWeights,
        args: Any,
        source_format: str,
        where: str,
        scheduler: dict | None,
        read_optimizer: Callable[[], OptimizerState],
    ) -> None:
        padded_vocab_size = args.padded_vocab_size
        recorded = getattr(args, "true_vocab_size", None)
        weights.config.model.true_vocab_size = recorded  # the loader kept every padded row
        divisor = (
            getattr(args, "make_vocab_size_divisible_by", None) or 128
        ) * args.tensor_model_parallel_size
        shardings = model_shardings(weights.config, padded_vocab_size, weights.family)
        self.iteration_dir = where
        self.source_format = source_format
        self.tp_size = self.pp_size = 1
        self.padded_vocab_size = padded_vocab_size
        self.metadata = {
            "iteration": weights.iteration,
            "consumed_train_samples": getattr(args, "consumed_train_samples", 0) or 0,
            "consumed_valid_samples": getattr(args, "consumed_valid_samples", 0) or 0,
            "padded_vocab_size": padded_vocab_size,
            "true_vocab_size_range": (
                (recorded - 1, recorded) if recorded else true_vocab_range(padded_vocab_size, divisor)
            ),
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "world_size": 1,
            "opt_param_scheduler": scheduler,
            "args": config_to_dict(weights.config),
            "model_type": weights.family.name,
        }
        experts = expert_names(weights.config, padded_vocab_size, weights.family)
        # every expert in one tensor, of which each rank of any EP x expert TP layout cuts its part
        self.ep_size = 1
        self.params = {
            name: sharding_record(
                list(tensor.shape), shardings[name], False, 0, 1, 0, 1, name,
                ExpertLayout() if name in experts else None,
            )
            for name, tensor in sorted(weights.tensors.items(), key=lambda item: module_order(item[0]))
        }  # fmt: skip
        self._weights = weights.tensors
        self._read_optimizer: Callable[[], OptimizerState] | None = read_optimizer
        self._optimizer_state: OptimizerState | None = None
        self._optimizer_refusal = ""

    def _optimizer(self) -> OptimizerState | None:
        """The optimizer state, mapped on the first call; None (with the reason kept) where it does not map."""
        if self._read_optimizer is not None:
            try:
                self._optimizer_state = self._read_optimizer()
            except (UnmappedOptimizerState, CheckpointError) as error:
                self._optimizer_refusal = str(error)
            self._read_optimizer = None
        return self._optimizer_state

    def _shard(
        self, name: str, kind: str, tp_rank: int, pp_rank: int, ep_rank: int | None = None
    ) -> torch.Tensor:
        return self._weights[name] if kind == "model" else self._optimizer()[0][name]

    def _optimizer_meta(self) -> tuple[dict, set[str]]:
        tensors, meta = self._optimizer()
        return meta, set(tensors)

    def has_optimizer_state(self) -> bool:
        return self._optimizer() is not None

    def require_optimizer_state(self) -> None:
        if self._optimizer() is None:
            raise UnmappedOptimizerState(
                f"{self._optimizer_refusal}: pass --no-load-optim to continue from its weights with a fresh "
                "optimizer (or --finetune to start a new run from them)"
            )

    @property
    def optimizer_source(self) -> str:
        return f"the optimizer state of {self.iteration_dir}"

    def restore_rng_state(self, our_layout: tuple[int, int, int]) -> None:
        logger.warning(
            "%s is a Megatron-LM %s checkpoint: its RNG states are not restored (as --no-load-rng); dropout "
            "continues from this run's --seed",
            self.iteration_dir,
            self.source_format,
        )


def _scheduler_state(saved: dict | None, where: str) -> dict | None:
    """Megatron's `opt_param_scheduler` state when it has what ours reads, else None (the run's flags decide)."""
    if saved is not None and all(key in saved for key in SCHEDULER_KEYS):
        return {key: saved[key] for key in SCHEDULER_KEYS}
    logger.warning("%s holds no learning-rate scheduler state this version reads: the flags decide", where)
    return None


def converted_legacy(checkpoint: LegacyCheckpoint, family: ModelFamily) -> ConvertedCheckpoint:
    """A Megatron-LM `torch` checkpoint (every rank's file read) as one of ours, with its Adam state."""
    args = checkpoint.args
    weights = checkpoint.weights(args.padded_vocab_size, family)
    shardings = model_shardings(weights.config, args.padded_vocab_size, family)
    scheduler = _scheduler_state(
        checkpoint.files[(0, 0, 0)].get("opt_param_scheduler"), checkpoint.iteration_dir
    )
    return ConvertedCheckpoint(
        weights, args, "torch", checkpoint.iteration_dir, scheduler,
        lambda: legacy_optimizer_state(checkpoint, family, shardings),
    )  # fmt: skip


def converted_dist(checkpoint: DistCheckpoint, family: ModelFamily) -> ConvertedCheckpoint:
    """A Megatron-Core torch_dist checkpoint as one of ours, with its Adam state where it is saved in model space."""
    args = checkpoint.args
    weights = checkpoint.weights(args.padded_vocab_size, family)
    scheduler = _scheduler_state(checkpoint.common.get("opt_param_scheduler"), checkpoint.iteration_dir)
    return ConvertedCheckpoint(
        weights, args, "torch_dist", checkpoint.iteration_dir, scheduler,
        lambda: dist_optimizer_state(checkpoint, weights),
    )  # fmt: skip
