"""Megatron's OptimizerParamScheduler: warmup then decay of the learning rate, and a weight-decay ramp.

Steps are counted in samples (the scheduler is stepped by the global batch size each iteration), so a
batch-size ramp-up moves the schedule by the samples actually consumed, exactly as in Megatron.
"""

from __future__ import annotations

import math

import torch

from megatron_train.training.config import OptimizerConfig

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    """Sets `lr` and `weight_decay` of every param group from the number of samples consumed so far.

    A param group may carry `lr_mult` and `wd_mult` (Megatron's per-group multipliers; default 1) and its own
    `max_lr` / `min_lr` (--decoupled-lr / --decoupled-min-lr for the embedding and output layer).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool = False,
        override_opt_param_scheduler: bool = False,
    ) -> None:
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= --min-lr ({min_lr}) <= --lr ({max_lr})")
        if lr_decay_steps <= 0:
            raise ValueError(f"the lr decay length must be positive, got {lr_decay_steps} samples")
        if lr_warmup_steps >= lr_decay_steps and lr_decay_style != "constant":
            raise ValueError(
                f"warmup ({lr_warmup_steps} samples) must be shorter than decay ({lr_decay_steps} samples)"
            )
        if lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {lr_decay_style!r}: choose one of {DECAY_STYLES}")
        if wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"--weight-decay-incr-style {wd_incr_style!r}: choose one of {WD_INCR_STYLES}")
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler exclude each other"
            )
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError(f"constant weight decay needs start ({start_wd}) == end ({end_wd})")
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    def get_wd(self) -> float:
        """Weight decay after `num_steps` samples: start_wd ramping to end_wd over wd_incr_steps."""
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return self.end_wd
        incr_ratio = self.num_steps / self.wd_incr_steps
        delta_wd = self.end_wd - self.start_wd
        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        return self.start_wd + coeff * delta_wd

    def get_lr(self, param_group: dict | None = None) -> float:
        """The learning rate after `num_steps` samples (Megatron's `get_lr`, term by term), for `param_group`'s
        own `max_lr` / `min_lr` when it has them."""
        group = param_group or {}
        max_lr, min_lr = group.get("max_lr", self.max_lr), group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * self.num_steps / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            return max(min_lr, max_lr * warmup_steps**0.5 / num_steps**0.5)
        decay_ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advance by `increment` samples and write the new lr / weight decay into the param groups."""
        self.num_steps += increment
        new_wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = new_wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, name: str, ours: object, theirs: object) -> object:
        """Megatron's rule: this run's value wins with --override-opt-param-scheduler, the checkpoint's with
        --use-checkpoint-opt-param-scheduler; otherwise they must agree."""
        if self.override_opt_param_scheduler:
            return ours
        if not self.use_checkpoint_opt_param_scheduler and ours != theirs:
            raise ValueError(
                f"the checkpoint's scheduler has {name}={theirs} but this run has {name}={ours}; pass "
                "--override-opt-param-scheduler to use this run's value or --use-checkpoint-opt-param-scheduler "
                "to keep the checkpoint's"
            )
        return theirs

    def load_state_dict(self, state: dict) -> None:
        for name in (
            "max_lr",
            "min_lr",
            "lr_warmup_steps",
            "lr_decay_steps",
            "lr_decay_style",
            "start_wd",
            "end_wd",
            "wd_incr_steps",
            "wd_incr_style",
        ):
            setattr(self, name, self._check_and_set(name, getattr(self, name), state[name]))
        self.num_steps = 0
        self.step(state["num_steps"])


def build_opt_param_scheduler(
    optimizer: torch.optim.Optimizer,
    opt: OptimizerConfig,
    train_iters: int | None,
    train_samples: int | None,
    global_batch_size: int,
) -> OptimizerParamScheduler:
    """Megatron's `get_optimizer_param_scheduler`: turn iteration- or sample-based flags into sample counts."""
    if train_iters is not None and train_samples is None:
        lr_decay_steps = (opt.lr_decay_iters or train_iters) * global_batch_size
        wd_incr_steps = train_iters * global_batch_size
        warmup_steps = opt.lr_warmup_iters * global_batch_size
    elif train_samples is not None:
        lr_decay_steps = opt.lr_decay_samples or train_samples
        wd_incr_steps = train_samples
        warmup_steps = opt.lr_warmup_samples
    else:
        raise ValueError("set --train-iters or --train-samples")
    if opt.lr_warmup_fraction is not None:
        warmup_steps = int(opt.lr_warmup_fraction * lr_decay_steps)
    if opt.lr is None:
        raise ValueError("set --lr")
    start_wd = opt.weight_decay if opt.start_weight_decay is None else opt.start_weight_decay
    end_wd = opt.weight_decay if opt.end_weight_decay is None else opt.end_weight_decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=opt.lr_warmup_init,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=lr_decay_steps,
        lr_decay_style=opt.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=wd_incr_steps,
        wd_incr_style=opt.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=opt.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=opt.override_opt_param_scheduler,
    )
