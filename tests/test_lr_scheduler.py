"""The learning-rate and weight-decay schedules against their closed forms (Megatron's semantics)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_train.training.config import OptimizerConfig
from megatron_train.training.lr_scheduler import OptimizerParamScheduler, build_opt_param_scheduler


def _optimizer() -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    return torch.optim.AdamW(
        [{"params": params[:1], "wd_mult": 1.0}, {"params": params[1:], "wd_mult": 0.0}], lr=0.0
    )


def _scheduler(style: str, warmup: int = 10, decay: int = 100, **kwargs) -> OptimizerParamScheduler:
    settings = dict(
        init_lr=0.0,
        max_lr=1.0e-3,
        min_lr=1.0e-5,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=style,
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=decay,
        wd_incr_style="constant",
    )
    settings.update(kwargs)
    return OptimizerParamScheduler(_optimizer(), **settings)


def _lr_at(scheduler: OptimizerParamScheduler, step: int) -> float:
    scheduler.num_steps = 0
    scheduler.step(step)
    return scheduler.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("step", [0, 1, 5, 10])
def test_linear_warmup(step: int) -> None:
    assert _lr_at(_scheduler("cosine"), step) == pytest.approx(1.0e-3 * step / 10)


@pytest.mark.parametrize("step", [11, 40, 73, 100])
def test_linear_and_cosine_decay_closed_form(step: int) -> None:
    ratio = (step - 10) / 90
    linear = 1.0e-5 + (1.0 - ratio) * (1.0e-3 - 1.0e-5)
    cosine = 1.0e-5 + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (1.0e-3 - 1.0e-5)
    assert _lr_at(_scheduler("linear"), step) == pytest.approx(linear, rel=1e-12)
    assert _lr_at(_scheduler("cosine"), step) == pytest.approx(cosine, rel=1e-12)


def test_after_decay_is_min_lr_and_constant_is_max_lr() -> None:
    assert _lr_at(_scheduler("linear"), 101) == 1.0e-5
    assert _lr_at(_scheduler("cosine"), 500) == 1.0e-5
    assert _lr_at(_scheduler("constant"), 50) == 1.0e-3
    assert _lr_at(_scheduler("constant"), 500) == 1.0e-3


def test_inverse_square_root() -> None:
    scheduler = _scheduler("inverse-square-root", warmup=16, decay=1000)
    assert _lr_at(scheduler, 64) == pytest.approx(1.0e-3 * math.sqrt(16 / 64))
    assert _lr_at(scheduler, 999) == pytest.approx(max(1.0e-5, 1.0e-3 * 4 / math.sqrt(999)))


def test_weight_decay_ramp_and_no_decay_group() -> None:
    scheduler = _scheduler("constant", start_wd=0.0, end_wd=0.1, wd_incr_style="linear")
    scheduler.step(25)
    groups = scheduler.optimizer.param_groups
    assert groups[0]["weight_decay"] == pytest.approx(0.025)
    assert groups[1]["weight_decay"] == 0.0  # wd_mult 0: biases and norms
    scheduler.step(100)
    assert groups[0]["weight_decay"] == pytest.approx(0.1)
    cosine = _scheduler("constant", start_wd=0.0, end_wd=0.1, wd_incr_style="cosine")
    cosine.step(50)
    assert cosine.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.05)


def test_iteration_flags_become_sample_counts() -> None:
    """--train-iters 100 --lr-warmup-iters 10 at global batch 8: the schedule runs in samples, stepped by 8."""
    config = OptimizerConfig(lr=1.0e-3, min_lr=0.0, lr_decay_style="linear", lr_warmup_iters=10)
    scheduler = build_opt_param_scheduler(
        _optimizer(), config, train_iters=100, train_samples=None, global_batch_size=8
    )
    assert (scheduler.lr_warmup_steps, scheduler.lr_decay_steps) == (80, 800)
    for _ in range(55):
        scheduler.step(8)
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(1.0e-3 * (1.0 - 45 / 90))
    fraction = OptimizerConfig(lr=1.0e-3, lr_warmup_fraction=0.25, lr_decay_samples=400)
    by_samples = build_opt_param_scheduler(
        _optimizer(), fraction, None, train_samples=1000, global_batch_size=8
    )
    assert (by_samples.lr_warmup_steps, by_samples.lr_decay_steps, by_samples.wd_incr_steps) == (
        100,
        400,
        1000,
    )


def test_state_round_trip_and_mismatch() -> None:
    scheduler = _scheduler("cosine")
    scheduler.step(37)
    resumed = _scheduler("cosine")
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed.num_steps == 37
    assert resumed.optimizer.param_groups[0]["lr"] == scheduler.optimizer.param_groups[0]["lr"]
    different = _scheduler("cosine", max_lr=2.0e-3)
    with pytest.raises(ValueError, match=r"max_lr=0.001 but this run has max_lr=0.002.*override-opt-param"):
        different.load_state_dict(scheduler.state_dict())
    overriding = _scheduler("cosine", max_lr=2.0e-3, override_opt_param_scheduler=True)
    overriding.load_state_dict(scheduler.state_dict())
    assert overriding.max_lr == 2.0e-3 and overriding.num_steps == 37
    keeping = _scheduler("cosine", max_lr=2.0e-3, use_checkpoint_opt_param_scheduler=True)
    keeping.load_state_dict(scheduler.state_dict())
    assert keeping.max_lr == 1.0e-3


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="warmup"):
        _scheduler("linear", warmup=100, decay=100)
    with pytest.raises(ValueError, match="--min-lr"):
        _scheduler("linear", min_lr=1.0)
    with pytest.raises(ValueError, match="--lr"):
        build_opt_param_scheduler(_optimizer(), OptimizerConfig(), 10, None, 8)
