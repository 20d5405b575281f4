"""MoE GPTs trained with `pretrain_gpt` under expert parallelism, in two process groups: a one-process group
(the reference, its half run, a dense run and its upcycling) and a four-rank group whose layouts each continue
the one-process half run's checkpoint with the reference's losses (dropless routing: capacity is per rank, so
dropping legitimately differs between layouts); an EP=2 checkpoint loads at EP=1 with the reference's logits; the
aux and z losses are logged after `lm loss` and in TensorBoard under Megatron's names; a dense checkpoint upcycles
into experts computing the same function; a run killed with SIGKILL resumes bitwise; the CP2 x EP2 run saves
--ckpt-format torch_dist from every rank with Megatron-Core's expert keys and a TP2 x expert TP 2 x EP1 run continues
it with the reference's losses."""

from __future__ import annotations

import glob
import os
import shutil
import warnings

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint import FileSystemReader

from megatron_train.arguments import parse_args
from megatron_train.checkpointing import (
    CheckpointError,
    SavedCheckpoint,
    check_compatible,
    load_model_for_inference,
    read_metadata,
    require_iteration_dir,
)
from megatron_train.tools.checkpoint_util import convert_checkpoint
from tests.helpers.distributed import run_distributed
from tests.helpers.training import (
    pretrain_worker,
    read_marker,
    read_metrics,
    run_entry_point,
    sigkill_at_iteration,
    tiny_args,
    write_corpus,
)

pytestmark = pytest.mark.processes  # every test here reads runs of spawned process groups or starts one

# 4 layers, MoE in layers 1 and 3 (one per stage under PP=2): 4 experts of top-2, shared experts with a gate,
# aux and z losses; no biases and no dropout, so runs compare to float tolerance.
MOE = [
    "--num-layers", "4", "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "([0]+[1])*2",
    "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--disable-bias-linear",
    "--use-cpu-initialization", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--micro-batch-size", "1",
    "--train-iters", "4", "--split", "90,10,0", "--moe-shared-expert-intermediate-size", "16",
    "--moe-shared-expert-gate", "--log-params-norm", "--log-num-zeros-in-grad",
]  # fmt: skip
EP2 = ["--expert-model-parallel-size", "2"]
DIST_SAVE = ["--use-distributed-optimizer", "--ckpt-format", "torch_dist", "--save-interval", "1"]
# Aux-loss-free balancing (its expert bias is saved state), sequence and global aux losses, dropout on.
SIGKILL_MOE = [
    "--mock-data", "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type", "seq_aux_loss", "global_aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--disable-bias-linear", "--train-iters", "4",
    "--save-interval", "2", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
]  # fmt: skip
# name: (world size, flags, the run whose iteration-2 checkpoint it continues, or None: from scratch)
RUNS = {
    "reference": (1, ["--moe-grouped-gemm"], None),
    "half": (1, ["--exit-interval", "2"], None),
    "dense": (1, ["--num-experts", "0", "--train-iters", "2"], None),
    # dense TP 2 + SP, DP 2 (distributed optimizer); experts EP 2 x expert DP 2 (expert TP 1), alltoall
    "ep2-tp2-sp-distopt": (
        4,
        [
            *EP2,
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--expert-tensor-parallel-size",
            "1",
            "--use-distributed-optimizer",
            "--moe-token-dispatcher-type",
            "alltoall",
            "--moe-grouped-gemm",
        ],
        "half",
    ),  # fmt: skip
    # dense DP 4 (distributed optimizer, no model parallelism); experts EP 2 x expert DP 2, allgather
    "ep2-dp4-distopt": (4, [*EP2, "--use-distributed-optimizer"], "half"),
    # PP 2 (an MoE layer on each stage) x DP 2; experts EP 2, allgather
    "pp2-ep2": (4, [*EP2, "--pipeline-model-parallel-size", "2", "--tensorboard-dir", "{dir}/tb"], "half"),
    # virtual PP: 2 stages of 2 one-layer chunks (the MoE layers 1 and 3 both on stage 1) x DP 2; experts EP 2
    "pp2-vpp-ep2": (
        4,
        [*EP2, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
        "half",
    ),
    # CP 2 (ring attention) x DP 2; experts EP 2 x expert DP 2 (the CP ranks folded into expert DP), alltoall;
    # the distributed optimizer, saved in torch_dist at iterations 3 and 4 by every rank
    "cp2-ep2": (
        4,
        [*EP2, "--context-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall", *DIST_SAVE],
        "half",
    ),
    # its torch_dist iteration 3 at TP 2 + SP, expert TP 2, EP 1, DP 2 (distributed optimizer): the last step
    "tp2-etp2-ep1": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--ckpt-step",
            "3",
        ],
        "cp2-ep2",
    ),
}


def _argv(tmp, data: str, name: str) -> list[str]:
    _, flags, source = RUNS[name]
    flags = [flag.replace("{dir}", str(tmp / name)) for flag in flags]
    # continuing another layout's checkpoint: no RNG states for a new world size (none matter: no dropout)
    resume = ["--no-load-rng"] if source else []
    argv = tiny_args(str(tmp / name), "--data-path", data, *MOE, *flags, *resume)
    if source and RUNS[source][0] == RUNS[name][0]:  # a run of the same group before it: read in its folder
        argv[argv.index("--load") + 1] = str(tmp / source)
    return argv


def _upcycling_argv(tmp, data: str) -> list[str]:
    """--moe-use-upcycling from the dense run (of --ffn-hidden-size 128), validation only, without shared
    experts (they start at random)."""
    argv = tiny_args(str(tmp / "upcycled"), "--data-path", data, *MOE[: MOE.index("--moe-shared-expert-intermediate-size")],
                     "--moe-ffn-hidden-size", "128", "--moe-use-upcycling", "--skip-train")  # fmt: skip
    argv[argv.index("--load") + 1] = str(tmp / "dense")
    return argv


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """Every run of RUNS, the upcycling and the uninterrupted run of the SIGKILL test, one process group per world
    size; the runs' parent folder."""
    tmp = tmp_path_factory.mktemp("moe")
    data = write_corpus(str(tmp))
    one = ["reference", "half", "dense"]
    sigkill_reference = tiny_args(str(tmp / "sigkill-reference"), *SIGKILL_MOE)
    one_process = [*(_argv(tmp, data, n) for n in one), _upcycling_argv(tmp, data), sigkill_reference]
    run_distributed(pretrain_worker, 1, one_process, timeout=300)
    four = ["ep2-tp2-sp-distopt", "ep2-dp4-distopt", "pp2-ep2", "pp2-vpp-ep2", "cp2-ep2", "tp2-etp2-ep1"]
    for name in four:  # continue a one-process run's checkpoint in this run's own folder
        if RUNS[RUNS[name][2]][0] == 1:
            shutil.copytree(
                tmp / RUNS[name][2], tmp / name, ignore=shutil.ignore_patterns("metrics.jsonl", "tb")
            )
    run_distributed(pretrain_worker, 4, [_argv(tmp, data, name) for name in four], timeout=300)
    return tmp


def _steps(tmp, name: str) -> list[dict]:
    return [r for r in read_metrics(str(tmp / name)) if "split" not in r]


def _losses(tmp, name: str, key: str = "lm loss") -> list[float]:
    return [r[key] for r in _steps(tmp, name)]


@pytest.mark.parametrize(
    "name",
    ["half", "ep2-tp2-sp-distopt", "ep2-dp4-distopt", "pp2-ep2", "pp2-vpp-ep2", "cp2-ep2", "tp2-etp2-ep1"],
)
def test_every_layout_continues_the_one_process_checkpoint_with_its_losses(moe_runs, name) -> None:
    """The losses, and the grad and params norms and zeros in the grad, whose expert part is reduced over the
    expert ranks (--log-params-norm, --log-num-zeros-in-grad); tp2-etp2-ep1 continues cp2-ep2's torch_dist save."""
    reference = _steps(moe_runs, "reference")
    assert len(reference) == 4 and len({r["lm loss"] for r in reference}) == 4
    steps = _steps(moe_runs, name)
    expected = {"half": reference[:2], "tp2-etp2-ep1": reference[3:]}.get(name, reference[2:])
    assert [r["iteration"] for r in steps] == [r["iteration"] for r in expected]
    for key in ("lm loss", "load_balancing_loss", "z_loss", "params norm", "grad norm"):
        np.testing.assert_allclose(
            [r[key] for r in steps], [r[key] for r in expected], rtol=1e-5, err_msg=f"{name} {key}"
        )
    # the zero entries of the grad, each counted once over the dense and the expert ranks
    assert [r["num zeros"] for r in steps] == [r["num zeros"] for r in expected] and expected[0][
        "num zeros"
    ] > 0


def test_an_ep2_checkpoint_loads_at_ep1_with_the_one_process_logits(moe_runs) -> None:
    """The EP=2 x TP=2 run's last checkpoint, merged into one process, computes the reference's last logits."""
    tokens = torch.arange(16).remainder(100).unsqueeze(0)
    logits = []
    for name in ("ep2-tp2-sp-distopt", "reference"):
        model, _ = load_model_for_inference(str(moe_runs / name), device="cpu")
        with torch.no_grad():
            logits.append(model(tokens))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


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
    (events,) = glob.glob(str(moe_runs / "pp2-ep2" / "tb" / "events.out.tfevents.*"))
    accumulator = EventAccumulator(events)
    accumulator.Reload()
    scalars = set(accumulator.Tags()["scalars"])
    assert {"lm loss", "load_balancing_loss", "z_loss"} <= scalars
    assert [e.value for e in accumulator.Scalars("load_balancing_loss")] == pytest.approx(
        _losses(moe_runs, "pp2-ep2", "load_balancing_loss"), rel=1e-6
    )


def test_dense_checkpoint_upcycles_into_experts_that_compute_the_dense_model(moe_runs) -> None:
    """Every expert a copy of the dense MLP: a token's top-2 weights sum to 1, so the MoE model has the dense
    model's validation loss."""
    (upcycled,) = [r for r in read_metrics(str(moe_runs / "upcycled")) if r.get("split") == "valid"]
    (dense,) = [r for r in read_metrics(str(moe_runs / "dense")) if r.get("split") == "valid"]
    assert upcycled["lm loss"] == pytest.approx(dense["lm loss"], rel=1e-6)


def test_moe_run_killed_with_sigkill_resumes_bitwise(moe_runs, tmp_path) -> None:
    """`python -m megatron_train.pretrain_gpt` killed at iteration 3 (checkpoint 2 on disk) and rerun logs the
    uninterrupted run's losses bit for bit."""
    killed = str(tmp_path / "killed")
    sigkill_at_iteration(run_entry_point("megatron_train.pretrain_gpt", tiny_args(killed, *SIGKILL_MOE)), 3)
    assert read_marker(killed) == 2
    output, _ = run_entry_point("megatron_train.pretrain_gpt", tiny_args(killed, *SIGKILL_MOE)).communicate(
        timeout=300
    )
    assert read_marker(killed) == 4, output
    resumed, reference = (
        [r for r in read_metrics(run) if "split" not in r]
        for run in (killed, str(moe_runs / "sigkill-reference"))
    )
    assert [r["iteration"] for r in resumed[-2:]] == [3, 4]
    for key in ("lm loss", "global_load_balancing_loss", "seq_load_balancing_loss"):
        assert [r[key] for r in resumed[-2:]] == [r[key] for r in reference[2:]], key


def test_checkpoint_util_reshards_experts_to_another_ep_and_expert_tp(moe_runs, tmp_path) -> None:
    """EP=2 x expert DP 2 (expert TP 1, distributed optimizer) to EP=4, expert TP 2 offline: every weight and
    optimizer tensor reads back the same, from the new layout's files."""
    source = moe_runs / "ep2-tp2-sp-distopt"
    out = convert_checkpoint(str(source), str(tmp_path / "out"), target_tp=2, target_ep=4, target_etp=2)
    before, after = (
        SavedCheckpoint(require_iteration_dir(str(run), None)) for run in (source, tmp_path / "out")
    )
    assert os.path.isdir(os.path.join(out, "mp_rank_01_expert_003")) and after.ep_size == 4
    assert list(after.params) == list(before.params)
    for name in before.params:
        torch.testing.assert_close(after.global_tensor(name), before.global_tensor(name), rtol=0, atol=0)
    states = before.optimizer_tensor_names({name: name for name in before.params})
    assert states == after.optimizer_tensor_names({name: name for name in after.params})
    for name in states.values():
        torch.testing.assert_close(
            after.global_tensor(name, "optimizer"), before.global_tensor(name, "optimizer")
        )


def test_torch_dist_save_of_every_rank_has_megatron_core_expert_keys_and_refuses_other_experts(
    moe_runs,
) -> None:
    """cp2-ep2's torch_dist iteration 3: every rank wrote part of the experts' Adam moments (EP 2 x expert DP 2,
    distributed optimizer); megatron-core reads each MoE layer's experts per layer (layers 1 and 3 MoE, 0 and 2
    dense) on an expert axis; another --num-experts or --moe-ffn-hidden-size is refused naming the saved value."""
    folder = str(moe_runs / "cp2-ep2" / "iter_0000003")
    index = FileSystemReader(folder).read_metadata()
    experts = {info.relative_path for at, info in index.storage_data.items() if ".experts.experts." in at.fqn
               and at.fqn.startswith("optimizer.state.exp_avg.")}  # fmt: skip
    assert experts == {f"__{rank}_0.distcp" for rank in range(4)}
    with warnings.catch_warnings():  # megatron-core warns that TransformerEngine and Apex are not installed
        warnings.simplefilter("ignore")
        from megatron.core import dist_checkpointing

        tensors = dist_checkpointing.load_tensors_metadata(folder)
    assert tuple(tensors["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].global_shape) == (
        4,
        16,
        32,
    )
    assert tuple(tensors["optimizer.state.exp_avg.decoder.layers.3.mlp.experts.experts.linear_fc2.weight"]
                 .global_shape) == (4, 32, 16)  # fmt: skip
    assert tuple(tensors["decoder.layers.0.mlp.linear_fc1.weight"].global_shape) == (128, 32)
    metadata = read_metadata(folder)
    for flag, value, saved in (("--num-experts", "8", 4), ("--moe-ffn-hidden-size", "32", 16)):
        argv = _argv(moe_runs, "unused", "half")
        config = parse_args([*argv, flag, value])
        with pytest.raises(CheckpointError, match=f"pass {flag} {saved} or load a matching checkpoint$"):
            check_compatible(metadata, config, metadata["padded_vocab_size"], folder)
    # a dense checkpoint into this MoE run: the flag to drop, not "pass --num-experts None"; and an inverted flag
    ours = parse_args(_argv(moe_runs, "unused", "half"))
    for changed, expected in (
        ({"num_experts": None}, "num_experts=4; drop --num-experts"),
        (
            {"add_bias_linear": not ours.model.add_bias_linear},
            f"{'pass' if ours.model.add_bias_linear else 'drop'} --disable-bias-linear",
        ),
    ):
        lying = {**metadata, "args": {**metadata["args"], "model": {**metadata["args"]["model"], **changed}}}
        with pytest.raises(CheckpointError, match=f"{expected} or load a matching checkpoint$"):
            check_compatible(lying, ours, metadata["padded_vocab_size"], folder)
