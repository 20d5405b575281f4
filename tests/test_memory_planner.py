"""The planner (`tools.report_theoretical_memory`): its Megatron line equals what Megatron-LM's own function
(tests/fixtures/megatron_lm, commit d98e8a64) computes for GPT-3 175B, Llama-3 8B and Mixtral 8x7B layouts, and its
exact per-rank bytes of parameters, gradients and optimizer state equal those the tensors of --bf16 runs hold
under TP, PP, DP with and without the distributed optimizer, CP, EP (MoE) and for a hybrid Mamba model (under CP
with the distributed optimizer), whose Megatron line is Megatron's refusal."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from megatron_train.arguments import parse_args
from megatron_train.families.registry import get_family, named_family
from megatron_train.parallel import state
from megatron_train.tools.report_theoretical_memory import main as planner_main
from megatron_train.tools.report_theoretical_memory import padded_vocab
from megatron_train.training.memory_plan import stage_memory
from megatron_train.training.theoretical_memory import megatron_line, megatron_memory_args
from tests.fixtures.megatron_lm import theoretical_memory_usage as megatron_reference
from tests.helpers.distributed import run_distributed
from tests.helpers.training import tiny_args

GPT3_175B = [  # examples/gpt3/train_gpt3_175b_distributed.sh's model, TP8 x PP16 on 1024 GPUs (Megatron's README)
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
    "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "1536", "--fp16",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16", "--train-iters", "500000",
    "--lr", "6.0e-5", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "gpt2-vocab.json",
    "--true-vocab-size", "50257", "--world-size", "1024",
]  # fmt: skip
LLAMA3_8B = [  # examples/llama/train_llama3_8b_h100_fp8.sh's model in bf16, on 64 GPUs: TP2 x CP2 x PP2 x DP8
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
    "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128", "--seq-length", "8192",
    "--max-position-embeddings", "8192", "--position-embedding-type", "rope", "--swiglu", "--normalization",
    "RMSNorm", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout", "0",
    "--micro-batch-size", "1", "--global-batch-size", "128", "--bf16", "--train-iters", "100", "--lr", "1.5e-4",
    "--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--sequence-parallel", "--use-distributed-optimizer", "--tokenizer-type", "NullTokenizer", "--vocab-size",
    "128256", "--world-size", "64",
]  # fmt: skip

# a tiny hybrid model of each layer kind: Mamba (8 heads in 2 groups), attention, MLP
HYBRID = ["--model-family", "hybrid", "--hybrid-layer-pattern", "M*-", "--mamba-state-dim", "8", "--mamba-head-dim",
          "8", "--mamba-num-groups", "2", "--attention-dropout", "0"]  # fmt: skip


def _megatron_reference(args, num_microbatches: int) -> str:
    """Megatron-LM's `report_theoretical_memory` on `args`: the line it prints."""
    args.hybrid_layer_pattern = None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        megatron_reference.report_theoretical_memory(args, num_microbatches=num_microbatches)
    return next(line for line in printed.getvalue().splitlines() if line.startswith("Theoretical"))


def _planned_args(argv: list[str]):
    world = int(argv[argv.index("--world-size") + 1])
    flags = argv[: argv.index("--world-size")]
    config = parse_args(flags, world)
    args = megatron_memory_args(config, world, padded_vocab(config))
    micro = config.training.global_batch_size // (config.training.micro_batch_size * args.data_parallel_size)
    return args, micro


@pytest.mark.parametrize(
    "argv",
    [GPT3_175B, LLAMA3_8B, [*LLAMA3_8B, "--recompute-activations"]],
    ids=["gpt3-175b", "llama3-8b", "llama3-8b-selective-recompute"],
)
def test_megatron_line_is_megatron_lms_own(argv) -> None:
    args, micro = _planned_args(argv)
    assert megatron_line(args, micro) == _megatron_reference(args, micro)


def test_megatron_line_of_a_mixtral_8x7b_layout() -> None:
    """Mixtral 8x7B's shape (8 experts of Llama's MLP, top 2) on 64 GPUs, EP8 x PP4 x TP2: the MoE terms of the
    formulas, our port against Megatron's function."""
    args, micro = _planned_args(
        [*LLAMA3_8B[: LLAMA3_8B.index("--tensor-model-parallel-size")], "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "4", "--sequence-parallel", "--use-distributed-optimizer",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--world-size", "64"]
    )  # fmt: skip
    args.num_experts, args.moe_ffn_hidden_size, args.moe_router_topk = 8, 14336, 2
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = 8, 1
    assert megatron_line(args, micro) == _megatron_reference(args, micro)


def test_the_report_shows_stages_flops_traffic_and_step_time(capsys) -> None:
    planner_main(
        [*LLAMA3_8B, "--peak-tflops", "989", "--intra-node-bandwidth", "450", "--inter-node-bandwidth", "50"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Theoretical memory footprints: weight and optimizer=")
    assert "TP 2 x CP 2 x PP 2 x DP 8" in lines[1]
    stages = [line.split() for line in lines[3:5]]
    assert [row[:2] for row in stages] == [["0", "0-15"], ["1", "16-31"]]
    assert any(line.startswith("FLOPs per step: ") for line in lines)
    traffic = next(line for line in lines if line.startswith("Sent per rank per step"))
    assert "tensor parallel" in traffic and "context parallel" in traffic and "pipeline p2p" in traffic
    assert "pipeline bubble" in lines[-1]


# Megatron's old pattern flag alone names the family
@pytest.mark.parametrize(
    "flags", [["--hybrid-override-pattern", *HYBRID[3:]], HYBRID], ids=["override-pattern", "model-family"]
)
def test_a_hybrid_model_gets_megatrons_refusal_line_then_our_exact_figures(flags, capsys) -> None:
    planner_main([*_measured_argv(flags), "--world-size", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Theoretical memory footprints not yet supported for hybrid Mamba-Transformer models."
    assert lines[1].startswith(
        "Exact per-rank memory of the hybrid model on 2 ranks: TP 1 x CP 1 x PP 1 x DP 2,"
    )
    stage = lines[3].split()
    assert stage[:2] == ["0", "0-2"] and stage[6] == "-"
    assert lines[4].startswith("Hybrid Mamba model: the first line is Megatron's own")
    assert lines[5].startswith("FLOPs per step: ") and len(lines) == 6


# -- exact per-rank bytes against the tensors of real runs -------------------------------------------------------

MEASURED_LAYOUTS = {  # name: flags on two ranks
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": [],
    "dp2-distributed-optimizer": ["--use-distributed-optimizer"],
    "cp2": ["--context-parallel-size", "2", "--attention-dropout", "0"],
    # Mamba, attention and MLP layers (the mixer's heads split over CP, its weights whole), distributed optimizer
    "hybrid-cp2": [*HYBRID, "--context-parallel-size", "2", "--use-distributed-optimizer"],
    # each rank holds 2 of the 4 experts; their state sharded over expert DP 1, the dense state over DP 2
    "ep2-distributed-optimizer": [
        "--num-experts",
        "4",
        "--moe-ffn-hidden-size",
        "16",
        "--expert-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ],  # fmt: skip
}


def _measured_argv(flags: list[str]) -> list[str]:
    argv = tiny_args("/nonexistent", "--train-iters", "1", "--bf16", "--hidden-dropout", "0", *flags)
    argv = [a for a in argv if a not in ("--save", "--load", "/nonexistent")]
    if any(flag.startswith("--hybrid") for flag in flags):  # the pattern gives the layer count
        layers = argv.index("--num-layers")
        argv = argv[:layers] + argv[layers + 2 :]
    return argv


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages the tensors live in (views of one buffer count it once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _measure_worker(rank: int, world_size: int, layouts: dict[str, list[str]]) -> dict[str, tuple]:
    """Each layout trained one step on this rank: (pp rank, dp rank, params, grads, optimizer bytes)."""
    from megatron_train.device import get_device
    from megatron_train.training.loop import train_step
    from megatron_train.training.setup import (
        model_parallel_session,
        set_random_seed,
        setup_model_and_optimizer,
    )

    results = {}
    for name, flags in layouts.items():
        config = parse_args(_measured_argv(flags), world_size)
        family = get_family(named_family(flags) or "gpt")
        with model_parallel_session(config, config.parallel.pipeline_model_parallel_size, None):
            set_random_seed(7)
            setup = setup_model_and_optimizer(
                config, family.model_provider, padded_vocab(config), get_device()
            )
            tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))
            batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16),
                     "position_ids": torch.arange(16).expand(2, 16)}  # fmt: skip
            batches = iter([batch] * 8)
            train_step(family.forward_step, [batches], setup, config)
            optimizer = setup.optimizer
            params = [p for chunk in setup.unwrapped_model for p in chunk.parameters()]
            copies = [m for m, p in zip(optimizer.main_params, optimizer.model_params, strict=True)
                      if m is not None and m is not p]  # fmt: skip
            moments = [
                v
                for s in optimizer.optimizer.state.values()
                for v in s.values()
                if torch.is_tensor(v) and v.dim()
            ]
            results[name] = (
                state.get_pipeline_model_parallel_rank(),
                state.get_data_parallel_rank(),
                _storage_bytes(params),
                _storage_bytes(p.main_grad for p in params),
                _storage_bytes(copies) + _storage_bytes(moments),
            )
    return results


@pytest.fixture(scope="module")
def measured() -> list[dict[str, tuple]]:
    return run_distributed(_measure_worker, 2, MEASURED_LAYOUTS, timeout=300)


@pytest.mark.processes
@pytest.mark.parametrize("name", list(MEASURED_LAYOUTS))
def test_exact_per_rank_bytes_equal_the_tensors_of_a_run(measured, name) -> None:
    config = parse_args(_measured_argv(MEASURED_LAYOUTS[name]), 2)
    family, padded = get_family(named_family(MEASURED_LAYOUTS[name]) or "gpt"), padded_vocab(config)
    for rank in range(2):
        pp_rank, dp_rank, *bytes_held = measured[rank][name]
        planned = stage_memory(config, family, padded, 2, pp_rank, dp_rank)
        assert [planned.params_bytes, planned.grads_bytes, planned.optimizer_bytes] == bytes_held, (
            name,
            rank,
        )


@pytest.mark.processes
def test_the_distributed_optimizer_halves_each_ranks_optimizer_state_on_two_ranks(measured) -> None:
    whole, sharded = measured[0]["dp2"][4], measured[0]["dp2-distributed-optimizer"][4]
    assert 0.45 * whole < sharded < 0.55 * whole


def test_the_report_names_the_expert_layout_and_what_its_estimates_leave_out(capsys) -> None:
    planner_main([*_measured_argv(MEASURED_LAYOUTS["ep2-distributed-optimizer"]), "--world-size", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert "4 experts over EP 2 x expert TP 1 x expert DP 1" in lines[1]
    assert any(line.startswith("MoE: each rank's experts") and "no MoE terms" in line for line in lines)
