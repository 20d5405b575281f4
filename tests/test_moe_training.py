"""MoE GPTs trained with `pretrain_gpt` under expert parallelism: every layout continues one process's checkpoint
with its losses (dropless routing: capacity is per rank, so dropping legitimately differs between layouts), an
EP=2 checkpoint continues at EP=1, the aux and z losses are logged after `lm loss` and in TensorBoard under
Megatron's names, a dense checkpoint upcycles into experts computing the same function, and a run killed with
SIGKILL resumes bitwise."""

from __future__ import annotations

import glob
import os
import shutil

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_train.checkpointing import SavedCheckpoint, require_iteration_dir
from megatron_train.tools.checkpoint_util import convert_checkpoint
from tests.helpers.distributed import run_distributed
from tests.helpers.training import pretrain_worker, read_metrics, sigkill_and_resume, tiny_args, write_corpus

# 4 layers, MoE in layers 1 and 3 (one per stage under PP=2): 4 experts of top-2, shared experts with a gate,
# aux and z losses; no biases (expert TP > 1 takes none) and no dropout, so runs compare to float tolerance.
MOE = [
    "--num-layers", "4", "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "([0]+[1])*2",
    "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--disable-bias-linear",
    "--use-cpu-initialization", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--micro-batch-size", "1",
    "--train-iters", "4", "--split", "90,10,0",
]  # fmt: skip
SHARED = ["--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate"]
EP2, TP2 = ["--expert-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
# name: (world size, flags, the run whose iteration-2 checkpoint it continues, or None: from scratch)
RUNS = {
    "reference": (1, ["--moe-grouped-gemm"], None),
    "half": (1, ["--exit-interval", "2"], None),
    "dense": (1, ["--num-experts", "0", "--train-iters", "2"], None),
    "ep2": (2, [*EP2, *ALLTOALL, "--moe-grouped-gemm"], "half"),
    "ep2-allgather": (2, EP2, "half"),
    "pp2": (2, ["--pipeline-model-parallel-size", "2", "--tensorboard-dir", "{dir}/tb"], "half"),
    "half-ep2": (2, [*EP2, *ALLTOALL, "--exit-interval", "2"], None),
    "ep2-tp2-sp": (4, [*EP2, *TP2, *ALLTOALL], "half"),
    "ep2-dp4-distopt": (4, [*EP2, *ALLTOALL, "--use-distributed-optimizer"], "half"),
    "ep2-at-ep1": (1, [], "half-ep2"),
}


def _argv(tmp, data: str, name: str) -> list[str]:
    _, flags, source = RUNS[name]
    flags = [flag.replace("{dir}", str(tmp / name)) for flag in flags]
    # continuing another layout's checkpoint: no RNG states for a new world size (none matter: no dropout)
    resume = ["--no-load-rng"] if source else []
    return tiny_args(str(tmp / name), "--data-path", data, *MOE, *SHARED, *flags, *resume)


def _train(tmp, data: str, world_size: int, names: list[str]) -> None:
    for name in names:
        source = RUNS[name][2]
        if source:  # continue the source's checkpoint in this run's own folder
            shutil.copytree(tmp / source, tmp / name, ignore=shutil.ignore_patterns("metrics.jsonl", "tb"))
    run_distributed(pretrain_worker, world_size, [_argv(tmp, data, name) for name in names], timeout=300)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """Every run of RUNS, one process group per world size, in dependency order; the runs' parent folder."""
    tmp = tmp_path_factory.mktemp("moe")
    data = write_corpus(str(tmp))
    _train(tmp, data, 1, ["reference", "half", "dense"])
    _train(tmp, data, 2, ["ep2", "ep2-allgather", "pp2", "half-ep2"])
    _train(tmp, data, 4, ["ep2-tp2-sp", "ep2-dp4-distopt"])
    _train(tmp, data, 1, ["ep2-at-ep1"])
    return tmp


def _steps(tmp, name: str) -> list[dict]:
    return [r for r in read_metrics(str(tmp / name)) if "split" not in r]


def _losses(tmp, name: str, key: str = "lm loss") -> list[float]:
    return [r[key] for r in _steps(tmp, name)]


@pytest.mark.parametrize(
    "name", ["ep2", "ep2-allgather", "pp2", "ep2-tp2-sp", "ep2-dp4-distopt", "ep2-at-ep1"]
)
def test_every_layout_continues_the_one_process_checkpoint_with_its_losses(moe_runs, name) -> None:
    reference = _steps(moe_runs, "reference")
    assert len(reference) == 4 and len({r["lm loss"] for r in reference}) == 4
    continued = _steps(moe_runs, name)
    assert [r["iteration"] for r in continued] == [3, 4]
    for key in ("lm loss", "load_balancing_loss", "z_loss"):
        np.testing.assert_allclose(
            [r[key] for r in continued], [r[key] for r in reference[2:]], rtol=1e-5, err_msg=f"{name} {key}"
        )


def test_a_run_at_ep2_from_scratch_logs_the_one_process_losses(moe_runs) -> None:
    np.testing.assert_allclose(_losses(moe_runs, "half-ep2"), _losses(moe_runs, "reference")[:2], rtol=1e-5)


def test_aux_and_z_losses_follow_lm_loss_on_the_line_and_in_tensorboard(moe_runs) -> None:
    record = _steps(moe_runs, "reference")[0]
    keys = list(record)
    assert (
        keys.index("lm loss")
        < keys.index("load_balancing_loss")
        < keys.index("z_loss")
        < keys.index("loss scale")
    )
    # balanced routing gives a load-balancing loss near 1 (its minimum for top-k), the z-loss logsumexp^2
    assert 0.99 < record["load_balancing_loss"] < 1.2 and record["z_loss"] > 0
    (events,) = glob.glob(str(moe_runs / "pp2" / "tb" / "events.out.tfevents.*"))
    accumulator = EventAccumulator(events)
    accumulator.Reload()
    scalars = set(accumulator.Tags()["scalars"])
    assert {"lm loss", "load_balancing_loss", "z_loss"} <= scalars
    assert [e.value for e in accumulator.Scalars("load_balancing_loss")] == pytest.approx(
        _losses(moe_runs, "pp2", "load_balancing_loss"), rel=1e-6
    )


def test_dense_checkpoint_upcycles_into_experts_that_compute_the_dense_model(moe_runs, tmp_path) -> None:
    """--moe-use-upcycling: every expert a copy of the dense MLP (of --ffn-hidden-size 128); a token's top-2
    weights sum to 1, so the MoE model (without shared experts, which start at random) has the dense model's
    validation loss."""
    data = write_corpus(str(tmp_path))
    flags = [*MOE, "--moe-ffn-hidden-size", "128", "--moe-use-upcycling", "--skip-train"]
    argv = tiny_args(str(tmp_path / "upcycled"), "--data-path", data, *flags)
    argv[argv.index("--load") + 1] = str(moe_runs / "dense")
    run_distributed(pretrain_worker, 1, [argv], timeout=300)
    (upcycled,) = [r for r in read_metrics(str(tmp_path / "upcycled")) if r.get("split") == "valid"]
    (dense,) = [r for r in read_metrics(str(moe_runs / "dense")) if r.get("split") == "valid"]
    assert upcycled["lm loss"] == pytest.approx(dense["lm loss"], rel=1e-6)


def test_moe_run_killed_with_sigkill_resumes_bitwise(tmp_path) -> None:
    """Aux-loss-free balancing (its expert bias is saved state), sequence and global aux losses, dropout on."""
    moe = [
        "--mock-data", "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type", "seq_aux_loss", "global_aux_loss",
        "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--disable-bias-linear",
    ]  # fmt: skip
    _, reference, killed = sigkill_and_resume(
        "megatron_train.pretrain_gpt", lambda run, *flags: tiny_args(run, *moe, *flags), tmp_path, 7
    )
    assert [r["lm loss"] for r in killed] == [r["lm loss"] for r in reference]
    assert [r["global_load_balancing_loss"] for r in killed] == [
        r["global_load_balancing_loss"] for r in reference
    ]


def test_checkpoint_util_reshards_experts_to_another_ep_and_expert_tp(moe_runs, tmp_path) -> None:
    """EP=2 (expert DP 2, distributed optimizer) to TP=2, EP=4, expert TP=1 offline: every weight and optimizer
    tensor reads back the same, from the new layout's files."""
    source = moe_runs / "ep2-dp4-distopt"
    out = convert_checkpoint(str(source), str(tmp_path / "out"), target_tp=2, target_ep=4, target_etp=1)
    before, after = (
        SavedCheckpoint(require_iteration_dir(str(run), None)) for run in (source, tmp_path / "out")
    )
    assert os.path.isdir(os.path.join(out, "mp_rank_00_expert_003")) and after.ep_size == 4
    assert list(after.params) == list(before.params)
    for name in before.params:
        torch.testing.assert_close(after.global_tensor(name), before.global_tensor(name), rtol=0, atol=0)
    states = before.optimizer_tensor_names({name: name for name in before.params})
    assert states == after.optimizer_tensor_names({name: name for name in after.params})
    for name in states.values():
        torch.testing.assert_close(
            after.global_tensor(name, "optimizer"), before.global_tensor(name, "optimizer")
        )
