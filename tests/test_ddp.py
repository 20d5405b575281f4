"""Data parallel: DP=2 equals one process at the same global batch, for our DDP (with and without overlap,
several buckets) and torch's; buckets reduce during backward; unused params do not hang the reduction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_train.distributed import DDPConfig, DistributedDataParallel, unwrap_model, wrap_data_parallel
from megatron_train.optimizer import get_megatron_optimizer
from megatron_train.training.config import OptimizerConfig
from tests.helpers.distributed import run_distributed

GLOBAL_BATCH, MICRO_BATCH, STEPS = 8, 2, 3
VARIANTS = [
    ("local", DDPConfig(overlap_grad_reduce=False, bucket_size=50)),
    ("local", DDPConfig(overlap_grad_reduce=True, bucket_size=50)),
    ("local", DDPConfig(overlap_grad_reduce=True)),
    ("torch", DDPConfig()),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randn(
        GLOBAL_BATCH, 1, generator=generator
    )


def _train(model: torch.nn.Module, dp_rank: int, dp_size: int) -> list[torch.Tensor]:
    """Megatron's step: each rank takes its slice of the global batch in micro-batches, loss / num_micro."""
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0), unwrap_model(model))
    num_micro = GLOBAL_BATCH // (MICRO_BATCH * dp_size)
    for step in range(STEPS):
        x, y = _batch(step)
        local = slice(dp_rank * GLOBAL_BATCH // dp_size, (dp_rank + 1) * GLOBAL_BATCH // dp_size)
        x, y = x[local], y[local]
        for micro in range(num_micro):
            part = slice(micro * MICRO_BATCH, (micro + 1) * MICRO_BATCH)
            last = micro == num_micro - 1
            context = model.no_sync() if hasattr(model, "no_sync") and not last else _nullcontext()
            with context:
                loss = (model(x[part]) - y[part]).pow(2).mean() / num_micro
                loss.backward()
        if hasattr(model, "finish_grad_sync"):
            model.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        if hasattr(model, "zero_grad_buffer"):
            model.zero_grad_buffer()
    return [p.detach().clone() for p in unwrap_model(model).parameters()]


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _dp_worker(rank: int, world_size: int) -> list[list]:
    """Weights after training under each variant (numpy: tensors do not survive the worker's exit)."""
    return [
        [p.numpy() for p in _train(wrap_data_parallel(_model(), impl, config, None), rank, world_size)]
        for impl, config in VARIANTS
    ]


@pytest.mark.processes
def test_data_parallel_equals_single_process(two_rank_results) -> None:
    reference = _train(_model(), 0, 1)
    for variant, (impl, config) in enumerate(VARIANTS):
        for rank in range(2):
            for ours, expected in zip(two_rank_results[rank]["dp"][variant], reference, strict=True):
                torch.testing.assert_close(
                    torch.from_numpy(ours), expected, rtol=1e-5, atol=1e-6, msg=f"{impl} {config} rank {rank}"
                )
    # the run really changed the weights
    assert not torch.equal(reference[0], _model()[0].weight)


def _overlap_worker(rank: int, world_size: int) -> dict:
    model = DistributedDataParallel(_model(), DDPConfig(overlap_grad_reduce=True, bucket_size=20))
    (model(torch.full((2, 8), float(rank + 1))).sum()).backward()
    launched_during_backward = [bucket.launched for bucket in model.buckets]
    model.finish_grad_sync()
    grads = {n: p.main_grad.numpy().copy() for n, p in model.module.named_parameters()}
    (buffer,) = model.buffers
    contiguous = all(p.main_grad.data_ptr() >= buffer.data_ptr() for p in model.module.parameters())
    return {
        "launched": launched_during_backward,
        "grads": grads,
        "contiguous": contiguous,
        "buckets": len(model.buckets),
    }


@pytest.mark.processes
def test_buckets_all_reduce_during_backward_and_average(two_rank_results) -> None:
    results = [ranks["overlap"] for ranks in two_rank_results]
    assert results[0]["buckets"] >= 3
    assert all(results[0]["launched"])  # every bucket started its all-reduce before backward returned
    assert results[0]["contiguous"]
    # the averaged grad equals the grad of the mean of both ranks' losses
    model = _model()
    ((model(torch.full((2, 8), 1.0)).sum() + model(torch.full((2, 8), 2.0)).sum()) / 2).backward()
    for name, param in model.named_parameters():
        for rank in range(2):
            torch.testing.assert_close(
                torch.from_numpy(results[rank]["grads"][name]), param.grad, rtol=1e-5, atol=1e-6
            )


class _PartlyUsed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_worker(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(rank)  # different initial weights per rank: the wrapper broadcasts rank 0's
    model = DistributedDataParallel(_PartlyUsed(), DDPConfig(overlap_grad_reduce=True, bucket_size=1))
    model(torch.full((1, 4), float(rank))).sum().backward()
    model.finish_grad_sync()
    dist.barrier()
    return [
        model.module.unused.weight.main_grad.abs().sum().item(),
        model.module.used.bias.main_grad[0].item(),
        model.module.used.weight.sum().item(),
    ]


def _two_rank_worker(rank: int, world_size: int) -> dict:
    """The three checks above in one process group: data parallel variants, overlapped buckets, unused params."""
    return {
        "dp": _dp_worker(rank, world_size),
        "overlap": _overlap_worker(rank, world_size),
        "unused": _unused_worker(rank, world_size),
    }


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    return run_distributed(_two_rank_worker, 2)


@pytest.mark.processes
def test_unused_params_are_reduced_at_finish_and_weights_start_equal(two_rank_results) -> None:
    results = [ranks["unused"] for ranks in two_rank_results]
    assert results[0] == results[1]
    assert results[0][:2] == [0.0, 1.0]


@pytest.mark.processes
def test_gpt_pretraining_dp2_and_tp2_equal_one_process(tmp_path) -> None:
    """pretrain_gpt at global batch 4: DP=1 with 2 micro-batches of 2 vs DP=2 with one each, for
    --ddp-impl local (with and without --overlap-grad-reduce) and torch, and vs TP=2 (with and without
    sequence parallel): the same losses and grad norms."""
    from tests.helpers.training import pretrain_worker, tiny_args, write_corpus

    prefix = write_corpus(str(tmp_path))
    # --use-cpu-initialization: TP=2 starts from TP=1's weights (sharded initialization draws per TP rank)
    common = ["--data-path", prefix, "--split", "90,10,0", "--train-iters", "4", "--hidden-dropout", "0.0",
              "--attention-dropout", "0.0", "--use-cpu-initialization"]  # fmt: skip
    (reference,) = run_distributed(pretrain_worker, 1, [tiny_args(str(tmp_path / "dp1"), *common)])[0]
    variants = [
        ["--ddp-impl", "local"],
        ["--ddp-impl", "local", "--overlap-grad-reduce", "--ddp-bucket-size", "1000"],
        ["--ddp-impl", "torch"],
        ["--tensor-model-parallel-size", "2"],  # DP=1 TP=2: the grad norm counts replicated params once
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ]
    runs = [tiny_args(str(tmp_path / f"dp2_{i}"), *common, *v) for i, v in enumerate(variants)]
    # the DP=1 run's final checkpoint resumed on 2 ranks (RNG states are per rank: --no-load-rng)
    resume = tiny_args(
        str(tmp_path / "dp2_resumed"),
        *common,
        "--train-iters",
        "6",
        "--no-load-rng",
        "--override-opt-param-scheduler",
    )  # a longer run: a new schedule
    resume[resume.index("--load") + 1] = str(tmp_path / "dp1")
    *results, resumed = run_distributed(pretrain_worker, 2, [*runs, resume])[1]  # the last rank logs
    assert [r["iteration"] for r in resumed if "split" not in r] == [5, 6]
    expected = [r["lm loss"] for r in reference if "split" not in r]
    assert len(expected) == 4 and expected[0] != expected[-1]
    expected_norms = [r["grad norm"] for r in reference if "split" not in r]
    for variant, records in zip(variants, results, strict=True):
        losses = [r["lm loss"] for r in records if "split" not in r]
        norms = [r["grad norm"] for r in records if "split" not in r]
        np.testing.assert_allclose(losses, expected, rtol=1e-5, err_msg=" ".join(variant))
        np.testing.assert_allclose(norms, expected_norms, rtol=1e-4, err_msg=" ".join(variant))


def test_single_process_buffer_accumulates_in_fp32_for_bf16() -> None:
    """Without torch.distributed the wrapper still accumulates micro-batches into its fp32 buffer."""
    module = _model().to(torch.bfloat16)
    model = DistributedDataParallel(module, DDPConfig(grad_reduce_in_fp32=True))
    assert [buffer.dtype for buffer in model.buffers] == [torch.float32]
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    with model.no_sync():
        model(x).float().sum().backward()
    model(x).float().sum().backward()
    model.finish_grad_sync()
    reference = _model().to(torch.bfloat16)
    reference(x).float().sum().backward()
    for param, expected in zip(module.parameters(), reference.parameters(), strict=True):
        assert param.grad is None and param.main_grad.dtype == torch.float32
        torch.testing.assert_close(param.main_grad, 2 * expected.grad.float(), rtol=1e-2, atol=1e-2)
    model.zero_grad_buffer()
    assert all(not p.main_grad.any() for p in module.parameters())
