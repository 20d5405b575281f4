"""Pipeline parallelism in the training loop. From the same initial weights, `pretrain` under PP=2 and PP=4
(1F1B), interleaved virtual stages, TP2 x PP2 with sequence parallel, PP2 x DP2, a rotary/untied Llama at
PP=4 and fp16 with overflowing steps at PP=2 logs the one-process run's losses, grad norms, skipped steps and
validation loss, and ends with its weights. `pretrain_gpt` at PP=2 resumes bitwise from its checkpoint;
Megatron's pipeline flag rules refuse bad layouts naming the flag to change."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from megatron_train.arguments import parse_args
from megatron_train.models.gpt import GPTModel
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
from tests.helpers.training import pretrain_worker, read_marker, tiny_args, write_corpus

# (rtol, atol) of final weights. Adam divides by sqrt(v), so the key bias (its grad is zero in exact arithmetic,
# rounding noise in practice) takes noise-driven steps: ~1e-6 apart in fp32 under TP's reordered sums. fp16:
# one ulp, the tied embedding's two grads summing in another order than in one process. bf16's noise moves the
# key bias by whole Adam steps either way, so bf16 runs compare losses and grad norms only.
WEIGHT_TOLERANCE = {torch.float32: (RTOL, 1e-5), torch.float16: (1e-3, 1e-4)}


def _train(records: list[dict], key: str) -> list:
    return [r[key] for r in records if "split" not in r]


def _valid(records: list[dict]) -> list[float]:
    return [r["lm loss"] for r in records if r.get("split") == "valid"]


MODELS = {
    "gpt": [],  # GPT-2: learned absolute positions, embedding tied to the output layer across the pipeline
    "llama": [  # rotary positions on every stage, untied output layer
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--normalization",
        "RMSNorm", "--swiglu", "--disable-bias-linear",
    ],
}  # fmt: skip
PP4 = ["--pipeline-model-parallel-size", "4"]
# 2^22 overflows the fp16 grads: the scale halves per step (hysteresis 1) until they fit; those steps skip
FP16 = ["--fp16", "--initial-loss-scale", "4194304", "--hysteresis", "1", "--train-iters", "6"]


class Case(NamedTuple):
    world_size: int
    model: str
    reference: str | None  # the one-process case it must train like (None: it is one)
    flags: list[str]
    rtol: float = RTOL  # of losses and grad norms


CASES = {
    "gpt": Case(1, "gpt", None, []),
    "gpt-fp16": Case(1, "gpt", None, FP16),
    "gpt-bf16": Case(1, "gpt", None, ["--bf16"]),
    "llama": Case(1, "llama", None, []),
    "pp2": Case(2, "gpt", "gpt", PP2),  # 1F1B
    "pp2-virtual": Case(2, "gpt", "gpt", [*PP2, *VIRTUAL]),  # interleaved 1F1B
    "pp2-fp16": Case(2, "gpt", "gpt-fp16", [*PP2, *FP16]),  # every stage skips the same steps
    # bf16 activations between stages; one process sums the tied embedding's two grads in bf16 (autograd
    # accumulates .grad in the param dtype), the pipeline in its fp32 grad buffer: grad norms differ by ~1e-4
    "pp2-bf16": Case(2, "gpt", "gpt-bf16", [*PP2, "--bf16"], rtol=1e-3),
    "pp4": Case(4, "gpt", "gpt", PP4),
    "tp2-pp2-sp": Case(4, "gpt", "gpt", [*PP2, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2-dp2": Case(4, "gpt", "gpt", PP2),
    "pp2-virtual-dp2": Case(4, "gpt", "gpt", [*PP2, *VIRTUAL]),
    "pp4-virtual-one-chunk": Case(4, "gpt", "gpt", [*PP4, *VIRTUAL]),  # interleaved, one chunk per rank
    "llama-pp4": Case(4, "llama", "llama", PP4),
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, dict]:
    """Every case trained from its model's initial weights, in one process group per world size."""
    tmp = tmp_path_factory.mktemp("pipeline")
    data = write_corpus(str(tmp))
    initial = {}
    for model, flags in MODELS.items():
        torch.manual_seed(0)
        config = parse_args(argv(str(tmp), data, *flags), 1).model
        initial[model] = {
            name: p.detach().numpy() for name, p in GPTModel(config, PADDED_VOCAB).state_dict().items()
        }
    results = {"initial": initial}
    for world_size in (1, 2, 4):
        names = [name for name, case in CASES.items() if case.world_size == world_size]
        runs = [
            (argv(str(tmp / name), data, *MODELS[CASES[name].model], *CASES[name].flags), CASES[name].model)
            for name in names
        ]
        per_rank = run_distributed(pretrain_from_weights, world_size, initial, runs, timeout=300)
        for i, name in enumerate(names):
            results[name] = {
                "metrics": per_rank[-1][i]["metrics"],
                "weights": merge_weights([ranks[i] for ranks in per_rank]),
            }
    return results


@pytest.mark.processes
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.reference is not None])
def test_pipeline_layouts_train_like_one_process(layouts, name) -> None:
    case = CASES[name]
    reference, result = layouts[case.reference]["metrics"], layouts[name]["metrics"]
    expected = _train(reference, "lm loss")
    assert len({loss for loss in expected if loss is not None}) >= 2  # it trained
    assert_series_close(_train(result, "lm loss"), expected, case.rtol, f"{name}: lm loss")
    # the grad norm spans every stage, the tied embedding counted once
    assert_series_close(
        _train(result, "grad norm"), _train(reference, "grad norm"), case.rtol, f"{name}: grad norm"
    )
    for key in ("number of skipped iterations", "loss scale", "learning rate"):
        assert _train(result, key) == _train(reference, key), key
    assert_series_close(_valid(result), _valid(reference), case.rtol, f"{name}: valid loss")
    assert len(_valid(result)) == 1
    final, expected_final = layouts[name]["weights"], layouts[case.reference]["weights"]
    assert set(final) == set(expected_final)
    for param, values in final.items():
        if values.dtype not in WEIGHT_TOLERANCE:
            continue
        initial = torch.from_numpy(layouts["initial"][case.model][param]).to(values.dtype)
        assert not torch.equal(values, initial), f"{name} {param} did not train"
        rtol, atol = WEIGHT_TOLERANCE[values.dtype]
        torch.testing.assert_close(
            values, expected_final[param], rtol=rtol, atol=atol, msg=lambda m, p=param: f"{name} {p}: {m}"
        )


@pytest.mark.processes
def test_fp16_overflow_skips_steps_on_every_stage(layouts) -> None:
    skipped = _train(layouts["pp2-fp16"]["metrics"], "number of skipped iterations")
    assert skipped[0] == 1 and skipped[-1] == 0


@pytest.mark.processes
def test_pretrain_gpt_pp2_resumes_bitwise(tmp_path) -> None:
    """`pretrain_gpt` at PP=2 (its own random init): a run stopped by --exit-interval and resumed from its
    checkpoint logs the uninterrupted run's losses."""
    data = ["--data-path", write_corpus(str(tmp_path)), "--split", "90,10,0", "--num-layers", "4",
            "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--train-iters", "4"]  # fmt: skip
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    runs = [tiny_args(full, *data), tiny_args(split, *data, "--exit-interval", "2"), tiny_args(split, *data)]
    last_rank = run_distributed(pretrain_worker, 2, runs, timeout=300)[-1]
    reference, stopped, resumed = (_train(records, "lm loss") for records in last_rank)
    assert len(reference) == 4 and len(set(reference)) == 4
    assert stopped == reference[:2]
    assert resumed == reference
    assert read_marker(full) == 4 and read_marker(split) == 4


def _refusal(capsys, world_size: int, *extra: str) -> str:
    with pytest.raises(SystemExit):
        parse_args(tiny_args("/tmp/unused", *extra), world_size)
    return capsys.readouterr().err


def test_pipeline_flags_follow_megatrons_rules(capsys) -> None:
    interleaved = ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                   "--num-layers-per-virtual-pipeline-stage", "1"]  # fmt: skip
    config = parse_args(
        tiny_args("/tmp/unused", "--train-iters", "1", *interleaved, "--global-batch-size", "8"), 4
    )
    assert config.parallel.virtual_pipeline_model_parallel_size(config.model.num_layers) == 2
    error = _refusal(
        capsys, 2, "--train-iters", "1", "--num-layers", "3", "--pipeline-model-parallel-size", "2"
    )
    assert "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2" in error
    error = _refusal(
        capsys, 2, "--train-iters", "1", *interleaved[:4], "--num-layers-per-virtual-pipeline-stage", "3"
    )
    assert "--num-layers 4 must split evenly" in error
    # global batch 6 / (micro-batch 2 x DP 1) = 3 micro-batches, not a multiple of PP 2
    error = _refusal(capsys, 2, "--train-iters", "1", *interleaved, "--global-batch-size", "6")
    assert "multiple of --pipeline-model-parallel-size 2" in error and "= 3;" in error
    assert "--global-batch-size" in error
    # a batch-size ramp 2, 4, 6, 8: its first step has 1 micro-batch
    error = _refusal(capsys, 2, "--train-samples", "40", "--rampup-batch-size", "2", "2", "8", *interleaved,
                     "--global-batch-size", "8")  # fmt: skip
    assert "global batch size 2" in error and "= 1;" in error
    error = _refusal(capsys, 1, "--train-iters", "1", "--num-layers-per-virtual-pipeline-stage", "1")
    assert "needs --pipeline-model-parallel-size > 1" in error
    error = _refusal(
        capsys, 2, "--train-iters", "1", "--pipeline-model-parallel-size", "2", "--ddp-impl", "torch"
    )
    assert "needs --ddp-impl local" in error
