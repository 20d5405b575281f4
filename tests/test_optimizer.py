"""Optimizer wrapper: param groups, fp32 main params, the fp16 loss scaler, clipping and state round trips."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_train.optimizer import (
    DynamicGradScaler,
    MegatronOptimizer,
    get_megatron_optimizer,
    get_param_groups,
)
from megatron_train.training.config import OptimizerConfig


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).to(
        dtype
    )


def _backward(model: torch.nn.Module, scale: float = 1.0, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=generator).to(next(model.parameters()).dtype)
    (model(x).float().pow(2).mean() * scale).backward()


def test_biases_and_norms_are_not_decayed() -> None:
    groups = get_param_groups(list(_model().named_parameters()))
    shapes = [[tuple(p.shape) for p in g["params"]] for g in groups]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
    assert shapes == [[(16, 8), (4, 16)], [(16,), (16,), (16,), (4,)]]


def test_fp32_step_equals_torch_adamw_and_clips() -> None:
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.05)
    model, reference = _model(), _model()
    optimizer = get_megatron_optimizer(config, model)
    decay = [p for n, p in reference.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in reference.named_parameters() if p.dim() == 1]
    torch_adamw = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1
    )
    optimizer.param_groups[1]["weight_decay"] = 0.0  # what the scheduler does with wd_mult 0
    for seed in range(3):
        _backward(model, seed=seed)
        _backward(reference, seed=seed)
        norm = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ok, grad_norm, _ = optimizer.step()
        torch_adamw.step()
        assert ok and grad_norm == pytest.approx(norm, rel=1e-5)
        assert norm > 0.05  # clipping was active
        optimizer.zero_grad()
        torch_adamw.zero_grad()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_bf16_keeps_fp32_main_params() -> None:
    """An update far below bf16's resolution accumulates in the fp32 main param."""
    model = _model(torch.bfloat16)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-6, optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0), model, torch.bfloat16
    )
    start = [p.detach().float().clone() for p in optimizer.main_params]
    for _ in range(3):
        _backward(model)
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.grad_scaler is None
    assert all(m.dtype == torch.float32 for m in optimizer.main_params)
    moved = [(m - s).abs().max().item() for m, s in zip(optimizer.main_params, start, strict=True)]
    assert all(0 < d < 1e-4 for d in moved)
    for model_param, main in zip(model.parameters(), optimizer.main_params, strict=True):
        assert model_param.dtype == torch.bfloat16
        assert torch.equal(model_param, main.to(torch.bfloat16))


def test_dynamic_scaler_hysteresis_backoff_and_growth() -> None:
    scaler = DynamicGradScaler(initial_scale=2.0**10, min_scale=2.0**8, growth_interval=3, hysteresis=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**10  # first overflow: hysteresis absorbs it
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**9
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**8
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**8  # floor: --min-loss-scale
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 2.0**8
    scaler.update(found_inf=False)  # third clean step in a row: grow, refill hysteresis
    assert (scaler.scale, scaler.hysteresis_tracker, scaler.growth_tracker) == (2.0**9, 2, 0)
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**9


def test_fp16_overflow_skips_the_step_then_trains() -> None:
    config = OptimizerConfig(lr=1e-3, initial_loss_scale=2.0**16, hysteresis=1, loss_scale_window=1000)
    model = _model(torch.float16)
    optimizer = get_megatron_optimizer(config, model, torch.float16)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model, scale=optimizer.get_loss_scale())
    next(model.parameters()).grad[0, 0] = float("inf")
    ok, grad_norm, _ = optimizer.step()
    assert (ok, grad_norm) == (False, None)
    assert optimizer.get_loss_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.optimizer.state == {}  # Adam never saw the bad grads
    optimizer.zero_grad()
    _backward(model, scale=optimizer.get_loss_scale())
    ok, grad_norm, _ = optimizer.step()
    assert ok and math.isfinite(grad_norm)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_fp16_loss_scale_is_undone() -> None:
    """The scaled fp16 backward gives the grad norm of the unscaled fp32 backward (to fp16 accuracy)."""
    fp32 = _model()
    _backward(fp32)
    expected = torch.cat([p.grad.flatten() for p in fp32.parameters()]).norm().item()
    model = _model(torch.float16)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, loss_scale=1024.0), model, torch.float16)
    _backward(model, scale=optimizer.get_loss_scale())
    ok, grad_norm, _ = optimizer.step()
    assert ok and grad_norm == pytest.approx(expected, rel=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_log_num_zeros_in_grad_counts_the_zero_entries_of_the_unscaled_grads(dtype: torch.dtype) -> None:
    """Megatron's count_zeros_fp32: zero entries over the whole model's (fp32 main) grads; None when not asked."""
    model = _model(dtype)
    config = OptimizerConfig(lr=1e-3, loss_scale=1024.0, log_num_zeros_in_grad=True)
    optimizer = get_megatron_optimizer(config, model, dtype)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[:, :3] = 0.0  # the first layer's weight gets zero grads in these 3 input columns: 16 x 3 entries
    (model(x).float().pow(2).mean() * optimizer.get_loss_scale()).backward()
    expected = sum(p.grad.numel() - int(torch.count_nonzero(p.grad)) for p in model.parameters())
    assert expected >= 48
    ok, _, num_zeros = optimizer.step()
    assert ok and num_zeros == expected
    quiet_model = _model()
    quiet = get_megatron_optimizer(OptimizerConfig(lr=1e-3), quiet_model)
    _backward(quiet_model)
    assert quiet.step()[2] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_dict_round_trip_continues_identically(dtype: torch.dtype) -> None:
    config = OptimizerConfig(lr=1e-2, initial_loss_scale=2.0**12)
    model_a = _model(dtype)
    opt_a = get_megatron_optimizer(config, model_a, dtype)
    for seed in range(2):
        _backward(model_a, scale=opt_a.get_loss_scale(), seed=seed)
        opt_a.step()
        opt_a.zero_grad()
    tensors, meta = opt_a.state_dict()
    model_b = _model(dtype)
    model_b.load_state_dict(model_a.state_dict())
    opt_b = get_megatron_optimizer(config, model_b, dtype)
    opt_b.load_state_dict({k: v.clone() for k, v in tensors.items()}, meta)
    assert opt_b.get_loss_scale() == opt_a.get_loss_scale()
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        _backward(model, scale=opt.get_loss_scale(), seed=5)
        opt.step()
    for a, b in zip(opt_a.main_params, opt_b.main_params, strict=True):
        assert torch.equal(a, b)


def test_state_dict_mismatch_names_the_problem() -> None:
    tensors, meta = get_megatron_optimizer(OptimizerConfig(lr=1e-3), _model()).state_dict()
    other = MegatronOptimizer(list(torch.nn.Linear(2, 2).named_parameters()), OptimizerConfig(lr=1e-3))
    with pytest.raises(ValueError, match=r"ckpt/optim: .*--no-load-optim"):
        other.load_state_dict(tensors, meta, source="ckpt/optim")
