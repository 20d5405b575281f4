"""The distributed optimizer (--use-distributed-optimizer): sharded training equals one process without it
(fp32, clipping, overlap with straddling params, DP=4, TP2 x DP2 with SP), bf16 and fp16 equal the replicated
optimizer, an overflow on one rank skips the step on every rank, per-rank memory follows Megatron's table,
and checkpoints move between sharded and replicated optimizers and DP sizes."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megatron_train.distributed import DDPConfig, DistributedDataParallel
from megatron_train.distributed.ddp import Bucket, DataParallelGroup
from megatron_train.models.gpt import GPTModel
from megatron_train.optimizer import DistributedOptimizer, MegatronOptimizer, get_megatron_optimizer
from megatron_train.optimizer.distrib_optimizer import shards_of_bucket
from megatron_train.training.config import OptimizerConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import tiny_config
from tests.helpers.training import tiny_args, write_corpus

VOCAB = 128
DIST = "--use-distributed-optimizer"
# Megatron's docs/distrib_optimizer.md: bytes per parameter = replicated + sharded / d
BYTES_PER_PARAM = {torch.float16: (4, 16), torch.bfloat16: (6, 12), torch.float32: (8, 8)}

# Adam is nearly blind to clipping (it rescales every step's grads alike): clipping is checked with SGD
SGD_CLIPPED = ["--optimizer", "sgd", "--lr", "0.5", "--clip-grad", "0.05"]
FP16 = ["--fp16", "--initial-loss-scale", "16777216", "--hysteresis", "1", "--train-iters", "12"]
# name -> flags, on top of tiny_args + 4 iterations, dropout 0, a real .bin/.idx; grouped by world size
RUNS_DP2 = {
    "dp2": [DIST],
    # reduce-scatter during backward, 1000-element buckets (params straddle ranks' parts), 2 micro-batches
    "dp2_overlap": [DIST, "--overlap-grad-reduce", "--ddp-bucket-size", "1000", "--micro-batch-size", "1"],
    "dp2_clip": [DIST, *SGD_CLIPPED],
    "dp2_bf16": [DIST, "--bf16"],
    "dp2_bf16_replicated": ["--bf16"],
    "dp2_fp16": [DIST, *FP16],
    "dp2_fp16_replicated": FP16,
    "saved_dp2": [DIST, "--exit-interval", "2"],
    "saved_dp2_bf16": [DIST, "--bf16", "--exit-interval", "2"],
}  # fmt: skip
RUNS_DP1 = {
    "dp1": [],  # 2 micro-batches of 2: the same global batch of 4
    "dp1_clip": SGD_CLIPPED,
    "dp1_sgd": ["--optimizer", "sgd", "--lr", "0.5", "--clip-grad", "0"],
    "resumed_dp1": ["--no-load-rng"],  # loads saved_dp2, saved with the distributed optimizer at DP=2
    "resumed_dp1_bf16": ["--bf16", "--no-load-rng"],  # loads saved_dp2_bf16
    "saved_dp1": ["--exit-interval", "2"],
}
RUNS_WORLD4 = {
    "dp4": [DIST, "--micro-batch-size", "1"],
    "tp2dp2": [DIST, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "resumed_dp4": [DIST, "--micro-batch-size", "1", "--no-load-rng"],  # loads saved_dp1
}
LOADS = {"resumed_dp1": "saved_dp2", "resumed_dp1_bf16": "saved_dp2_bf16", "resumed_dp4": "saved_dp1"}


def _gpt(dtype: torch.dtype) -> GPTModel:
    torch.manual_seed(0)
    config = tiny_config(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    return GPTModel(config, VOCAB)


def _backward(model: DistributedDataParallel, seed: int, loss_scale: float, sync: bool = True) -> None:
    """Next-token loss on random tokens, backward into the grad buffer, then (with `sync`) the DP reduction."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=generator)
    loss = model(tokens, labels=torch.roll(tokens, -1, dims=1)).float().mean()
    (loss * loss_scale).backward()
    if sync:
        model.finish_grad_sync()


def _flat_params(model: DistributedDataParallel) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.module.parameters()])


def _pretrain(runs: dict[str, list[str]], argvs: dict[str, list[str]]) -> None:
    from megatron_train.pretrain_gpt import main

    for name in runs:
        main(argvs[name])


def _held_bytes(model: DistributedDataParallel, optimizer: MegatronOptimizer) -> int:
    """Bytes of distinct storage behind model params, grad buffer, main params and grads, optimizer states."""
    tensors = [t for p in model.module.parameters() for t in (p, p.main_grad)]
    for main in optimizer.main_params:
        if main is not None:
            tensors += [main] + ([main.grad] if main.grad is not None else [])
    tensors += [v for s in optimizer.optimizer.state.values() for v in s.values() if v.dim() > 0]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _memory(rank: int, world_size: int) -> dict:
    """Per-rank bytes after one step, for each dtype and d in {1, 2, 4} (sub-groups of the 4 ranks), and
    for the replicated optimizer at d=1."""
    result = {}
    for d in (1, 2, 4):
        groups = [dist.new_group(list(range(first, first + d))) for first in range(0, world_size, d)]
        for dtype in BYTES_PER_PARAM:
            for distributed in (True, False) if d == 1 else (True,):
                ddp_config = DDPConfig(
                    grad_reduce_in_fp32=dtype == torch.bfloat16, use_distributed_optimizer=distributed
                )
                model = DistributedDataParallel(_gpt(dtype), ddp_config, groups[rank // d])
                config = OptimizerConfig(lr=1e-3, initial_loss_scale=1024.0)
                optimizer = get_megatron_optimizer(config, model, dtype, distributed)
                _backward(model, seed=rank, loss_scale=optimizer.get_loss_scale())
                assert optimizer.step()[0]
                numel = sum(p.numel() for p in model.module.parameters())
                assert {p.dtype for p in model.module.parameters()} == {dtype}
                owned = sum(m.numel() for m in optimizer.main_params if m is not None)
                result[(d, str(dtype), distributed)] = (_held_bytes(model, optimizer), numel, owned)
    return result


def _fp16_overflow(rank: int, world_size: int) -> dict:
    """An inf that after the reduce-scatter sits only in rank 1's part: both ranks must skip the step."""
    model = DistributedDataParallel(_gpt(torch.float16), DDPConfig(use_distributed_optimizer=True))
    config = OptimizerConfig(lr=1e-3, initial_loss_scale=1024.0, hysteresis=1)
    optimizer = DistributedOptimizer(model, config, torch.float16)
    before = _flat_params(model)
    _backward(model, seed=rank, loss_scale=optimizer.get_loss_scale(), sync=False)
    bucket = model.buckets[0]
    if rank == 1:
        bucket.data[bucket.data.numel() // 2] = float("inf")  # the first element of rank 1's part
    model.finish_grad_sync()
    own_part_finite = bool(torch.isfinite(bucket.shard(bucket.data)).all())
    skipped = optimizer.step()
    after_skip = _flat_params(model)
    scale_after_skip = optimizer.get_loss_scale()
    optimizer.zero_grad()
    model.zero_grad_buffer()
    _backward(model, seed=rank + 1, loss_scale=optimizer.get_loss_scale())
    stepped = optimizer.step()
    final = _flat_params(model)
    return {
        "own_part_finite": own_part_finite,
        "skipped": skipped,
        "unchanged": bool(torch.equal(before, after_skip)),
        "scale": scale_after_skip,
        "stepped": stepped[0],
        "final": final.numpy(),
        "changed": bool((final != before).any()),
    }


def _world2(rank: int, world_size: int, argvs: dict[str, list[str]]) -> dict:
    overflow = _fp16_overflow(rank, world_size)
    _pretrain(RUNS_DP2, argvs)
    return overflow


def _world1(rank: int, world_size: int, argvs: dict[str, list[str]]) -> None:
    _pretrain(RUNS_DP1, argvs)


def _world4(rank: int, world_size: int, argvs: dict[str, list[str]]) -> dict:
    memory = _memory(rank, world_size)
    _pretrain(RUNS_WORLD4, argvs)
    return memory


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run of this module in three process groups (DP=2, then DP=1, then 4 ranks: each resume needs
    the previous group's checkpoint): the runs' parent folder and the in-worker results."""
    tmp = tmp_path_factory.mktemp("distopt")
    # --use-cpu-initialization: the TP=2 run starts from the DP=1 run's weights
    common = ["--data-path", write_corpus(str(tmp)), "--split", "90,10,0", "--train-iters", "4",
              "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--use-cpu-initialization"]  # fmt: skip
    argvs = {}
    for name, extra in {**RUNS_DP2, **RUNS_DP1, **RUNS_WORLD4}.items():
        argv = tiny_args(str(tmp / name), *common, *extra)
        if name in LOADS:
            argv[argv.index("--load") + 1] = str(tmp / LOADS[name])
        argvs[name] = argv
    overflow = run_distributed(_world2, 2, argvs)
    run_distributed(_world1, 1, argvs)
    memory = run_distributed(_world4, 4, argvs)
    return {"dir": tmp, "overflow": overflow, "memory": memory}


def _records(runs: dict, name: str) -> list[dict]:
    with open(runs["dir"] / name / "metrics.jsonl") as handle:
        return [r for r in map(json.loads, handle) if "split" not in r]


def _losses(runs: dict, name: str) -> list[float]:
    return [r["lm loss"] for r in _records(runs, name)]


def _final_weights(runs: dict, name: str) -> dict[str, torch.Tensor]:
    *_, last = sorted(glob.glob(str(runs["dir"] / name / "iter_*")))
    return load_file(os.path.join(last, "mp_rank_00", "model.safetensors"))


def _relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """|a - b| / |b| over the whole model (one tensor alone can be tiny: the key bias gets ~no gradient)."""
    assert a.keys() == b.keys()
    squares = [((a[k].float() - b[k].float()).pow(2).sum(), b[k].float().pow(2).sum()) for k in a]
    return (sum(d for d, _ in squares) / sum(n for _, n in squares)).sqrt().item()


@pytest.mark.processes
def test_sharded_training_equals_one_process_without_it(runs) -> None:
    """DP=2 (also overlapped, accumulating, params straddling), DP=4 and TP2 x DP2 with SP: the losses and
    grad norms of 4 iterations, and the final weights, of DP=1."""
    expected = _losses(runs, "dp1")
    norms = [r["grad norm"] for r in _records(runs, "dp1")]
    assert len(expected) == 4 and expected[0] != expected[-1]
    reference = _final_weights(runs, "dp1")
    for name in ("dp2", "dp2_overlap", "dp4", "tp2dp2"):
        np.testing.assert_allclose(_losses(runs, name), expected, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose([r["grad norm"] for r in _records(runs, name)], norms, rtol=1e-4)
    for name in ("dp2", "dp2_overlap", "dp4"):
        assert _relative_difference(_final_weights(runs, name), reference) < 1e-5, name


@pytest.mark.processes
def test_clipping_is_global_across_shards(runs) -> None:
    """SGD clipped to 0.05 (every step clips): the sharded norm and update equal one process's."""
    clipped = _records(runs, "dp1_clip")
    assert all(r["grad norm"] > 0.05 for r in clipped)
    # clipping really changed the run (padding rows no longer in the softmax: unclipped SGD gains less than 1%)
    unclipped = _losses(runs, "dp1_sgd")
    assert not np.allclose(unclipped, [r["lm loss"] for r in clipped], rtol=1e-3)
    np.testing.assert_allclose(_losses(runs, "dp2_clip"), [r["lm loss"] for r in clipped], rtol=1e-5)
    np.testing.assert_allclose(
        [r["grad norm"] for r in _records(runs, "dp2_clip")], [r["grad norm"] for r in clipped], rtol=1e-4
    )
    assert _relative_difference(_final_weights(runs, "dp2_clip"), _final_weights(runs, "dp1_clip")) < 1e-5


@pytest.mark.processes
def test_bf16_and_fp16_equal_the_replicated_optimizer(runs) -> None:
    """Same DP=2 run with and without sharding; fp16 starts at 2^24 and skips until the scale fits."""
    np.testing.assert_allclose(_losses(runs, "dp2_bf16"), _losses(runs, "dp2_bf16_replicated"), rtol=1e-5)
    sharded, replicated = _records(runs, "dp2_fp16"), _records(runs, "dp2_fp16_replicated")
    fields = ("number of skipped iterations", "loss scale")
    assert [[r[f] for f in fields] for r in sharded] == [[r[f] for f in fields] for r in replicated]
    skipped = [r["number of skipped iterations"] for r in sharded]
    assert skipped[:3] == [1, 1, 1] and skipped[-1] == 0
    losses = [(a["lm loss"], b["lm loss"]) for a, b in zip(sharded, replicated, strict=True) if a["lm loss"]]
    assert len(losses) >= 2
    np.testing.assert_allclose(*zip(*losses, strict=True), rtol=1e-3)


@pytest.mark.processes
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(runs) -> None:
    first, second = runs["overflow"]
    assert first["own_part_finite"] and not second["own_part_finite"]
    for rank in (first, second):
        assert rank["skipped"] == (False, None, None) and rank["unchanged"] and rank["scale"] == 512.0
        assert rank["stepped"] and rank["changed"]
    np.testing.assert_array_equal(first["final"], second["final"])  # the all-gather kept replicas equal


@pytest.mark.processes
def test_per_rank_memory_follows_megatrons_table(runs) -> None:
    for rank, held in enumerate(runs["memory"]):
        for (d, dtype, distributed), (held_bytes, numel, owned) in held.items():
            replicated, sharded = BYTES_PER_PARAM[getattr(torch, dtype.removeprefix("torch."))]
            assert numel % 4 == 0  # no bucket padding: the table holds exactly
            assert owned == (numel // d if distributed else numel)
            assert held_bytes == replicated * numel + sharded * numel // d, (rank, d, dtype, distributed)


@pytest.mark.parametrize("dp_size", [1, 3, 4, 5])
def test_params_straddling_rank_parts_are_split_as_megatron_does(dp_size: int) -> None:
    """Each rank owns an equal part of the padded bucket; a param cut by a part boundary is shared."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (2, 5, 3)]
    owned = []  # per rank: (param index, start, end) in the flattened param
    for rank in range(dp_size):
        dp = DataParallelGroup(None, rank, dp_size, 1.0 / dp_size)
        bucket = Bucket(params, [0, 2, 7], torch.zeros(-(-10 // dp_size) * dp_size), None, dp)
        shards = shards_of_bucket(bucket)
        owned.append([(i, shards[p].start, shards[p].end) for i, p in enumerate(params) if p in shards])
    tiles = [(i, start, end) for ranges in owned for i, start, end in ranges]
    assert sum(end - start for _, start, end in tiles) == 10  # every element once; padding owned by none
    if dp_size == 4:  # parts of 3 in a bucket padded to 12
        assert owned == [[(0, 0, 2), (1, 0, 1)], [(1, 1, 4)], [(1, 4, 5), (2, 0, 2)], [(2, 2, 3)]]


@pytest.mark.processes
def test_checkpoints_move_between_sharded_and_replicated_and_dp_sizes(runs) -> None:
    """Saved at iteration 2 with the distributed optimizer at DP=2, resumed at DP=1 without it; saved at
    DP=1 without it, resumed with it at DP=4: iterations 3 and 4 equal the uninterrupted run."""
    expected = _losses(runs, "dp1")
    assert _losses(runs, "saved_dp2") == pytest.approx(expected[:2], rel=1e-5)
    for name in ("resumed_dp1", "resumed_dp4"):
        assert [r["iteration"] for r in _records(runs, name)] == [3, 4]
        np.testing.assert_allclose(_losses(runs, name), expected[2:], rtol=1e-5, err_msg=name)
    # the same state as the replicated optimizer's after the same two steps, whole (gathered over DP)
    sharded, replicated = (
        runs["dir"] / name / "iter_0000002" / "mp_rank_00" for name in ("saved_dp2", "saved_dp1")
    )
    saved, expected_state = (load_file(str(d / "optimizer.safetensors")) for d in (sharded, replicated))
    assert len(saved) == 2 * len(list(_gpt(torch.float32).parameters()))  # exp_avg and exp_avg_sq per param
    assert _relative_difference(saved, expected_state) < 1e-5
    meta, expected_meta = (json.loads((d / "optimizer.json").read_text()) for d in (sharded, replicated))
    assert (
        meta["scalars"] == expected_meta["scalars"] and meta["param_groups"] == expected_meta["param_groups"]
    )


def test_tied_word_embedding_gets_a_bucket_of_its_own() -> None:
    """Pipeline stages sum the tied embedding's grads after the reduce-scatter: its DP split must not depend on
    the stage's other params."""
    module = _gpt(torch.float32)
    tied = module.shared_embedding_or_output_weight()
    buckets = DistributedDataParallel(module, DDPConfig(use_distributed_optimizer=True)).buckets
    assert [len(b.params) for b in buckets if any(p is tied for p in b.params)] == [1]
    assert sum(len(b.params) for b in buckets) == len(list(module.parameters()))


def test_refuses_torch_ddp_and_a_plain_module() -> None:
    from megatron_train.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(tiny_args("/tmp/unused", "--train-iters", "1", DIST, "--ddp-impl", "torch"), 1)
    with pytest.raises(ValueError, match="DDPConfig\\(use_distributed_optimizer=True\\)"):
        DistributedOptimizer(torch.nn.Linear(2, 2), OptimizerConfig(lr=1e-3))


@pytest.mark.processes
def test_bf16_checkpoint_holds_the_gathered_fp32_main_params(runs) -> None:
    """Every rank's fp32 main shard lands in its place: the gathered main params round exactly to the saved
    bf16 weights; resumed at DP=1 without sharding, iterations 3 and 4 follow the uninterrupted run."""
    shard = runs["dir"] / "saved_dp2_bf16" / "iter_0000002" / "mp_rank_00"
    saved, weights = (
        load_file(str(shard / "optimizer.safetensors")),
        load_file(str(shard / "model.safetensors")),
    )
    mains = {k.removesuffix(".main_param"): v for k, v in saved.items() if k.endswith(".main_param")}
    assert len(mains) == len(list(_gpt(torch.float32).parameters()))
    for name, main in mains.items():
        assert main.dtype == torch.float32 and torch.equal(main.bfloat16(), weights[name]), name
    np.testing.assert_allclose(_losses(runs, "resumed_dp1_bf16"), _losses(runs, "dp2_bf16")[2:], rtol=1e-5)
