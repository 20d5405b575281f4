"""The memory planner: what a run costs each GPU, from its pretrain flags, before it runs.

    python -m megatron_train.tools.report_theoretical_memory <pretrain_gpt flags> --world-size 1024 \\
        [--peak-tflops 989 --intra-node-bandwidth 450 --inter-node-bandwidth 50 --gpus-per-node 8]

Prints Megatron-LM's own line first (`training.theoretical_memory`: its formulas at commit d98e8a64 for the first
pipeline stage, approximations kept), then our exact figures per pipeline stage (`training.memory_plan`: every
parameter, gradient buffer and optimizer state a rank holds, built as training builds it), an activation
estimate with context parallelism and full recompute, the FLOPs of a step, the bytes a rank sends per step and,
given a peak TFLOP/s and link bandwidths (GB/s), an estimated step time with the pipeline bubble. The world size
is --world-size, else $WORLD_SIZE. The tokenizer's files give the vocabulary; without them pass
--true-vocab-size. For a hybrid Mamba model (--model-family hybrid, or a --hybrid-* flag) Megatron's line is its
refusal, as Megatron prints it (its formulas have no Mamba terms); our exact parameter, gradient and optimizer
figures per stage and the FLOPs follow, without the activation, traffic and step-time estimates (a transformer's).
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_train.arguments import MegatronConfig, parse_args
from megatron_train.families.registry import get_family, named_family
from megatron_train.tokenizer import tokenizer_from_config, vocab_size_with_padding
from megatron_train.training.entry import USER_ERRORS, check_family_config, padded_vocab_size_for
from megatron_train.training.memory_plan import (
    activation_bytes,
    communication_bytes,
    megabytes,
    stage_memory,
    stages_to_plan,
    step_time,
)
from megatron_train.training.theoretical_memory import megatron_line, megatron_memory_args

HYBRID_FLAGS = (
    "--hybrid-override-pattern",
    "--hybrid-layer-pattern",
    "--hybrid-attention-ratio",
    "--hybrid-mlp-ratio",
)
HYBRID_REFUSAL = "Theoretical memory footprints not yet supported for hybrid Mamba-Transformer models."
HYBRID_NOTE = (
    "Hybrid Mamba model: the first line is Megatron's own (its formulas have no Mamba terms); parameters, gradients "
    "and optimizer state are exact; activations, traffic and step time are not estimated for its layers."
)


def planner_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The planner's own flags, and the pretrain flags left."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "0")) or None)
    parser.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of one GPU (bf16 dense)")
    parser.add_argument("--intra-node-bandwidth", type=float, help="GB/s a GPU sends inside a node (NVLink)")
    parser.add_argument("--inter-node-bandwidth", type=float, help="GB/s a GPU sends across nodes")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    return parser.parse_known_args(argv)


def padded_vocab(config: MegatronConfig) -> int:
    """The padded vocabulary: from the tokenizer, or from --true-vocab-size when its files are not here."""
    try:
        return padded_vocab_size_for(config, tokenizer_from_config(config.tokenizer))
    except (OSError, ValueError) as error:
        if config.model.true_vocab_size is None:
            raise ValueError(f"{error}; without the tokenizer's files pass --true-vocab-size") from error
        return vocab_size_with_padding(
            config.model.true_vocab_size,
            config.tokenizer.make_vocab_size_divisible_by,
            config.parallel.tensor_model_parallel_size,
        )


def report(argv: list[str]) -> list[str]:
    """The report's lines."""
    options, rest = planner_flags(argv)
    # Megatron takes a --hybrid-* flag for a hybrid model (args.is_hybrid_model), whatever the script
    hybrid_flag = any(flag in rest for flag in HYBRID_FLAGS)
    family = get_family(named_family(rest) or ("hybrid" if hybrid_flag else "gpt"))
    # Megatron's planner has no terms for Mamba layers, and our activation and traffic estimates are a transformer's
    estimated = family.name != "hybrid"
    if not options.world_size:
        raise ValueError("pass --world-size N (or set WORLD_SIZE): the number of GPUs of the planned run")
    config = parse_args(rest, options.world_size)
    check_family_config(family, config)
    padded = padded_vocab(config)
    world, parallel, training = options.world_size, config.parallel, config.training
    dp = parallel.data_parallel_size(world)
    micro = training.global_batch_size // (training.micro_batch_size * dp)
    lines = [
        megatron_line(megatron_memory_args(config, world, padded), micro) if estimated else HYBRID_REFUSAL
    ]
    precision = "bf16" if config.model.bf16 else "fp16" if config.model.fp16 else "fp32"
    lines.append(
        f"Exact per-rank memory of the {family.name} model on {world} ranks: TP {parallel.tensor_model_parallel_size}"
        f" x CP {parallel.context_parallel_size} x PP {parallel.pipeline_model_parallel_size} x DP {dp}, {precision}"
        f" params, {config.optimizer.optimizer}"
        + (" (distributed optimizer over DP x CP)" if parallel.use_distributed_optimizer else "")
        + (
            f", {config.model.num_experts} experts over EP {parallel.expert_model_parallel_size} x expert TP "
            f"{parallel.expert_tensor_size} x expert DP {parallel.expert_data_parallel_size(world)}"
            if config.model.is_moe
            else ""
        )
        + f", {micro} micro-batches of {training.micro_batch_size} x {config.model.seq_length} tokens a step"
    )
    lines.append(
        f"{'stage':>5} {'layers':>9} {'parameters':>14} {'params MB':>11} {'grads MB':>11} {'optimizer MB':>13} "
        f"{'activations MB':>15} {'total MB':>11}"
    )
    terms = family.terms(config, padded)
    flops = terms.flops_per_sample() * training.global_batch_size
    slowest: dict[str, float] = {}
    for pp_rank in stages_to_plan(config):
        stage = stage_memory(config, family, padded, world, pp_rank)
        activations = activation_bytes(config, stage, micro) if estimated else 0.0
        layers = f"{stage.layers[0]}-{stage.layers[-1]}" if stage.layers else "-"
        lines.append(
            f"{pp_rank:>5} {layers:>9} {stage.parameters:>14,} {megabytes(stage.params_bytes):>11.2f} "
            f"{megabytes(stage.grads_bytes):>11.2f} {megabytes(stage.optimizer_bytes):>13.2f} "
            + (f"{megabytes(activations):>15.2f}" if estimated else f"{'-':>15}")
            + f" {megabytes(stage.model_state_bytes + activations):>11.2f}"
        )
        sent = communication_bytes(config, stage, micro, world) if estimated else {}
        if sum(sent.values()) >= sum(slowest.values()):
            slowest = sent
    if estimated:
        lines.append(
            f"Activations are an estimate (Korthikanti et al. 2022, flash attention"
            f"{', full recompute' if config.model.recompute_granularity == 'full' else ''}, 1F1B micro-batches "
            "in flight); parameters, gradients and optimizer state are exact."
        )
        if config.model.is_moe:
            lines.append(
                "MoE: each rank's experts, router and their gradients and optimizer state are exact (sharded over "
                "expert DP); the activation estimate and the traffic count no MoE terms (routed tokens, expert "
                "activations, the dispatchers' exchanges)."
            )
    else:
        lines.append(HYBRID_NOTE)
    lines.append(f"FLOPs per step: {flops:.4e} ({flops / world:.4e} per rank, forward and backward)")
    if not estimated:
        return lines
    sent_text = (
        ", ".join(f"{kind} {megabytes(nbytes):,.1f} MB" for kind, nbytes in slowest.items()) or "nothing"
    )
    lines.append(f"Sent per rank per step (the busiest stage): {sent_text}")
    if options.peak_tflops and options.intra_node_bandwidth and options.inter_node_bandwidth:
        timing = step_time(
            config, flops, world, micro, slowest, options.peak_tflops, options.intra_node_bandwidth,
            options.inter_node_bandwidth, options.gpus_per_node,
        )  # fmt: skip
        lines.append(
            f"Estimated step time at {options.peak_tflops:g} TFLOP/s per GPU: compute {timing.compute:.3f} s + "
            f"pipeline bubble {timing.bubble:.3f} s + communication {timing.communication:.3f} s (not overlapped) "
            f"= {timing.total:.3f} s"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        lines = report(argv)
    except USER_ERRORS as error:
        raise SystemExit(f"report_theoretical_memory: {error}") from None
    print("\n".join(lines))


if __name__ == "__main__":
    main()
