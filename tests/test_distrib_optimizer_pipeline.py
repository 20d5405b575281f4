"""The distributed optimizer under pipeline parallelism, and torch's DDP accumulating over micro-batches.

From the same initial weights (a tiny fp32 GPT, dropout 0), `pretrain` with --use-distributed-optimizer under
PP2 x DP2 and under PP2 x 2 virtual stages x DP2 logs the one-process run's losses and grad norms and ends
with its weights (bf16 with --overlap-grad-reduce under virtual stages: the bf16 run's losses and grad norms);
each fp32 run stopped by --exit-interval resumes from its checkpoint with the uninterrupted run's losses and
weights, bitwise. --ddp-impl torch at DP2 with 2 micro-batches per rank trains like one process, and the
no-pipelining schedule lets torch's DDP reduce once per step, on the last micro-batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_train.arguments import parse_args
from megatron_train.distributed.ddp import DDPConfig, DistributedDataParallel, TorchDistributedDataParallel
from megatron_train.models.gpt import GPTModel
from megatron_train.optimizer import DistributedOptimizer, chunk_named_parameters
from megatron_train.parallel.schedules import forward_backward_no_pipelining
from megatron_train.training.config import OptimizerConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.pipeline_runs import (
    PADDED_VOCAB,
    PP2,
    RTOL,
    VIRTUAL,
    argv,
    assert_series_close,
    merge_weights,
    pretrain_from_weights,
)
from tests.helpers.training import write_corpus

DIST = ["--use-distributed-optimizer"]
ITERS = ["--train-iters", "4"]  # overrides argv's 3: two steps before the checkpoint, two after
# 4 ranks: name -> flags; the reference for all of them is one process
WORLD4 = {
    "pp2-dp2-dist": [*PP2, *DIST],
    "pp2-virtual-dp2-dist": [*PP2, *VIRTUAL, *DIST],
}
# bf16 params with fp32 main shards, grads reduce-scattered during backward; its reference is one bf16 process.
# bf16 rounding noise moves weights by whole Adam steps (see test_training_pipeline): losses and grad norms only,
# within bf16's unit roundoff (2**-8): by the fourth step the grad norms of the two reduction orders differ by ~2e-3.
BF16 = ["--bf16", "--overlap-grad-reduce"]
BF16_RTOL = 2**-8


def _train(records: list[dict], key: str) -> list:
    return [r[key] for r in records if "split" not in r]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, dict]:
    """Every layout trained from the same initial weights: one process, torch DDP at DP2, the distributed
    optimizer under PP2 x DP2 (plain and interleaved), each also stopped at iteration 2 and resumed."""
    tmp = tmp_path_factory.mktemp("distopt_pipeline")
    data = write_corpus(str(tmp))
    torch.manual_seed(0)
    config = parse_args(argv(str(tmp), data, *ITERS), 1).model
    initial = {"gpt": {n: p.detach().numpy() for n, p in GPTModel(config, PADDED_VOCAB).state_dict().items()}}

    def run(name: str, *flags: str) -> tuple[list[str], str]:
        return argv(str(tmp / name), data, *ITERS, *flags), "gpt"

    resumes = {}
    for name, flags in WORLD4.items():
        # stopped at iteration 2, then resumed in the same run dir: its metrics file continues the stopped run's
        checkpoint = ["--save", str(tmp / name / "checkpoint"), "--save-interval", "1000"]
        resumes[f"{name}-stopped"] = run(f"{name}-resumed", *flags, *checkpoint, "--exit-interval", "2")
        resumes[f"{name}-resumed"] = run(f"{name}-resumed", *flags, *checkpoint, "--load", checkpoint[1])
    groups = {
        1: {"gpt": run("gpt"), "gpt-bf16": run("gpt-bf16", "--bf16")},
        2: {"dp2-torch": run("dp2-torch", "--ddp-impl", "torch")},  # 8 / (2 x DP 2) = 2 micro-batches
        4: {
            **{name: run(name, *flags) for name, flags in WORLD4.items()},
            **resumes,
            "pp2-virtual-dp2-dist-bf16": run(
                "pp2-virtual-dp2-dist-bf16", *WORLD4["pp2-virtual-dp2-dist"], *BF16
            ),
        },
    }
    results = {"initial": initial["gpt"]}
    for world_size, cases in groups.items():
        per_rank = run_distributed(
            pretrain_from_weights, world_size, initial, list(cases.values()), timeout=300
        )
        for i, name in enumerate(cases):
            results[name] = {
                "metrics": per_rank[-1][i]["metrics"],
                "weights": merge_weights([ranks[i] for ranks in per_rank]),  # asserts DP replicas are equal
            }
    return results


def _assert_logs_like(layouts: dict, name: str, reference: str, rtol: float) -> None:
    """The reference's losses and grad norms, and every weight moved from its initial value."""
    expected, result = layouts[reference]["metrics"], layouts[name]["metrics"]
    assert len(set(_train(expected, "lm loss"))) == 4  # it trained
    assert_series_close(_train(result, "lm loss"), _train(expected, "lm loss"), rtol, f"{name}: lm loss")
    assert_series_close(
        _train(result, "grad norm"), _train(expected, "grad norm"), rtol, f"{name}: grad norm"
    )
    final = layouts[name]["weights"]
    assert set(final) == set(layouts[reference]["weights"])
    for param, values in final.items():
        initial = torch.from_numpy(layouts["initial"][param]).to(values.dtype)
        assert not torch.equal(values, initial), f"{name} {param} did not train"


def _assert_trains_like(layouts: dict, name: str, reference: str) -> None:
    """The reference's losses, grad norms and final weights (fp32)."""
    _assert_logs_like(layouts, name, reference, RTOL)
    for param, values in layouts[name]["weights"].items():
        torch.testing.assert_close(
            values,
            layouts[reference]["weights"][param],
            rtol=RTOL,
            atol=1e-5,
            msg=lambda m, p=param: f"{name} {p}: {m}",
        )


@pytest.mark.processes
@pytest.mark.parametrize("name", list(WORLD4))
def test_distributed_optimizer_with_pipeline_trains_like_one_process(layouts, name) -> None:
    _assert_trains_like(layouts, name, "gpt")


@pytest.mark.processes
def test_distributed_optimizer_bf16_with_virtual_stages_and_overlap_logs_like_one_process(layouts) -> None:
    _assert_logs_like(layouts, "pp2-virtual-dp2-dist-bf16", "gpt-bf16", BF16_RTOL)


@pytest.mark.processes
@pytest.mark.parametrize("name", list(WORLD4))
def test_distributed_optimizer_checkpoint_resumes_in_its_layout(layouts, name) -> None:
    """Two steps, save, exit; load and run two more: the uninterrupted run's losses and weights, bitwise."""
    stopped = _train(layouts[f"{name}-stopped"]["metrics"], "lm loss")
    uninterrupted = _train(layouts[name]["metrics"], "lm loss")
    assert stopped == uninterrupted[:2]
    assert _train(layouts[f"{name}-resumed"]["metrics"], "lm loss") == uninterrupted
    for param, values in layouts[f"{name}-resumed"]["weights"].items():
        assert torch.equal(values, layouts[name]["weights"][param]), param


@pytest.mark.processes
def test_torch_ddp_accumulating_micro_batches_trains_like_one_process(layouts) -> None:
    """Without the no_sync fix torch's DDP never reduced: DP replicas diverged (merge_weights refuses them)."""
    _assert_trains_like(layouts, "dp2-torch", "gpt")


# -- the schedule with torch's DDP, directly -----------------------------------------------------------------


def _linear_batches(rank: int, micro_batches: int) -> list[torch.Tensor]:
    return [torch.full((2, 4), float(1 + rank * micro_batches + i)) for i in range(micro_batches)]


class _Linear(torch.nn.Linear):
    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The schedules' hook; a single stage has no input tensor."""


def _torch_ddp_worker(rank: int, world_size: int, micro_batches: int) -> tuple[int, torch.Tensor]:
    """Count torch DDP's bucket reductions over one step of `micro_batches`; return them and the weight grad."""
    torch.manual_seed(0)
    model = TorchDistributedDataParallel(_Linear(4, 1, bias=False))
    reductions = []

    def counting_allreduce(_, bucket):  # unannotated: torch checks the annotations' real types
        reductions.append(bucket.index())
        tensor = bucket.buffer().div_(world_size)
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])

    model.register_comm_hook(None, counting_allreduce)
    batches = iter(_linear_batches(rank, micro_batches))

    def forward_step(iterator, chunk):
        output = chunk(next(iterator))
        return output, lambda out: (out.sum(), {})

    forward_backward_no_pipelining(
        forward_step, batches, model, micro_batches, seq_length=1, micro_batch_size=2
    )
    return len(reductions), model.module.weight.grad.clone()


@pytest.mark.processes
def test_no_pipelining_schedule_lets_torch_ddp_reduce_once_on_the_last_micro_batch() -> None:
    micro_batches, world_size = 3, 2
    results = run_distributed(_torch_ddp_worker, world_size, micro_batches)
    # d(sum(x @ w)) / dw = sum of x's rows; each rank's micro-batch losses are averaged, then ranks averaged
    rows = [b.sum(0) for rank in range(world_size) for b in _linear_batches(rank, micro_batches)]
    expected = torch.stack(rows).sum(0) / (micro_batches * world_size)
    for reductions, grad in results:
        assert reductions == 1
        torch.testing.assert_close(grad.view(-1), expected)


# -- the optimizer over several model chunks -----------------------------------------------------------------


def test_chunk_list_names_params_like_the_plain_optimizer() -> None:
    chunks = [torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)]
    assert [n for n, _ in chunk_named_parameters(chunks)] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert [n for n, _ in chunk_named_parameters(chunks[:1])] == ["weight", "bias"]
    ddps = [DistributedDataParallel(c, DDPConfig(use_distributed_optimizer=True)) for c in chunks]
    optimizer = DistributedOptimizer(ddps, OptimizerConfig(lr=1e-3))
    assert optimizer.names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert len(optimizer.buckets) == 2
    tensors, meta = optimizer.state_dict()
    assert meta["param_names"] == optimizer.names and tensors == {}
    with pytest.raises(ValueError, match="wrap each model chunk"):
        DistributedOptimizer(
            [ddps[0], DistributedDataParallel(chunks[1], DDPConfig())], OptimizerConfig(lr=1e-3)
        )


def test_virtual_stages_with_the_distributed_optimizer_are_accepted() -> None:
    layout = ["--num-layers", "4", *PP2, *VIRTUAL, *DIST, "--global-batch-size", "8"]
    config = parse_args(argv("/tmp/unused", "/tmp/unused", *layout), 4)
    assert config.parallel.use_distributed_optimizer
    assert config.parallel.virtual_pipeline_model_parallel_size(config.model.num_layers) == 2
