"""Megatron-LM's theoretical memory footprint (megatron/training/theoretical_memory_usage.py at Megatron-LM commit
d98e8a64), so the planner (`tools/report_theoretical_memory`) prints the line a Megatron user knows:

    Theoretical memory footprints: weight and optimizer=X MB, activation=Y MB, total=Z MB

for the most loaded (first) pipeline stage, with Megatron's own approximations kept: bf16 weights with fp32
gradients, main params and Adam moments (18 bytes a parameter, 6 + 12 / DP with the distributed optimizer),
the first stage holding the embedding plus 1/PP of the layers, activations by Korthikanti et al. (2022) table 2
(with sequence parallelism and selective recompute) or Megatron's estimate without sequence parallelism (+5%).
MoE layers and grouped-query attention are in the formulas; the exact figures of our own layout are
`rank_memory`'s. `args` is a namespace with Megatron's argument names (`megatron_memory_args`).
"""

from __future__ import annotations

import argparse

from megatron_train.arguments import MegatronConfig

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


def megatron_memory_args(
    config: MegatronConfig, world_size: int, padded_vocab_size: int
) -> argparse.Namespace:
    """The fields of Megatron's `args` its memory formulas read, from our config of a run on `world_size` ranks."""
    model, parallel = config.model, config.parallel
    tp, pp, cp = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.context_parallel_size,
    )
    num_experts = getattr(model, "num_experts", None)
    return argparse.Namespace(
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        kv_channels=model.kv_channels,
        group_query_attention=model.group_query_attention,
        num_query_groups=model.num_query_groups,
        num_layers=model.num_layers,
        ffn_hidden_size=model.ffn_hidden_size,
        swiglu=model.swiglu,
        normalization=model.normalization,
        add_bias_linear=model.add_bias_linear,
        untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
        padded_vocab_size=padded_vocab_size,
        seq_length=model.seq_length,
        micro_batch_size=config.training.micro_batch_size,
        num_experts=num_experts,
        moe_ffn_hidden_size=getattr(model, "moe_ffn_hidden_size", None),
        moe_router_topk=getattr(model, "moe_router_topk", 2),
        moe_layer_freq=getattr(model, "moe_layer_pattern", 1),
        moe_shared_expert_intermediate_size=getattr(model, "moe_shared_expert_intermediate_size", None),
        moe_shared_expert_gate=getattr(model, "moe_shared_expert_gate", False),
        moe_latent_size=None,
        mtp_num_layers=None,
        multi_latent_attention=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=getattr(parallel, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(parallel, "expert_tensor_parallel_size", None) or tp,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size(model.num_layers),
        world_size=world_size,
        data_parallel_size=world_size // (tp * pp * cp),
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        sequence_parallel=parallel.sequence_parallel,
        recompute_granularity=model.recompute_granularity,
    )


def weight_and_optimizer_bytes(args: argparse.Namespace) -> float:
    """Megatron's `compute_weight_and_optimizer_memory`: the most loaded shard's parameters times the bytes a
    parameter costs (bf16 weights, fp32 grads, main params and Adam moments)."""
    query_projection_size = args.kv_channels * args.num_attention_heads
    query_groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    num_experts = 1 if args.num_experts is None else args.num_experts
    gated = 3 / 2 if args.swiglu else 1
    shared_ffn = args.moe_shared_expert_intermediate_size or 0
    if args.num_experts is not None:
        freq = args.moe_layer_freq
        pattern = (
            [1 if i % freq == 0 else 0 for i in range(args.num_layers)] if isinstance(freq, int) else freq
        )
        moe_ffn = args.moe_ffn_hidden_size
    else:
        pattern, moe_ffn = [0] * args.num_layers, 0
    moe_layers = sum(pattern)
    dense_layers = args.num_layers - moe_layers
    norm_size = 1 if args.normalization == "RMSNorm" else 2
    attention = (
        2 * args.hidden_size * args.hidden_size
        * ((1 + query_groups / args.num_attention_heads) * query_projection_size / args.hidden_size)
    )  # fmt: skip
    embedding = args.hidden_size * args.padded_vocab_size
    final_layernorm = norm_size * args.hidden_size
    dense_mlp = 2 * args.hidden_size * args.ffn_hidden_size * gated
    shared_expert = 2 * args.hidden_size * shared_ffn * gated
    routed_experts = 2 * args.hidden_size * moe_ffn * num_experts * gated
    layernorms = 2 * args.hidden_size * norm_size
    router = (
        args.hidden_size * num_experts + (num_experts if args.add_bias_linear else 0)
        if args.num_experts is not None
        else 0
    )
    shared_gate = args.hidden_size if shared_ffn > 0 and args.moe_shared_expert_gate else 0
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    etp, ep = args.expert_tensor_parallel_size, args.expert_model_parallel_size
    expert_dp = args.world_size // (etp * ep * pp)
    tp_sharded = (attention + dense_mlp) * dense_layers + (attention + shared_expert) * moe_layers
    replicated = (
        layernorms * dense_layers + (layernorms + router + shared_gate) * moe_layers + final_layernorm
    )
    expert_sharded = routed_experts * moe_layers
    tp_sharded_on_shard = (tp_sharded / pp + embedding) / tp
    replicated_on_shard = replicated / pp
    expert_on_shard = expert_sharded / pp / (etp * ep)
    if args.untie_embeddings_and_output_weights and pp == 1:
        tp_sharded_on_shard += embedding / tp

    def bytes_per_parameter(data_parallel_size: int) -> float:
        return 18 if not args.use_distributed_optimizer else 6 + 12 / data_parallel_size

    return (tp_sharded_on_shard + replicated_on_shard) * bytes_per_parameter(
        args.data_parallel_size
    ) + expert_on_shard * bytes_per_parameter(expert_dp)


def _schedule_factor(args: argparse.Namespace, num_microbatches: int | None) -> float:
    """Megatron's in-flight micro-batch factor of the first stage's activations."""
    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if vp is not None:
        return 1 + (pp - 1) / (pp * vp)
    if pp > 1 and num_microbatches is not None:
        return min(1, num_microbatches / pp)
    return 1.0


def activation_bytes_with_sp(args: argparse.Namespace, num_microbatches: int | None) -> float:
    """Megatron's `compute_activation_memory` (sequence parallel, selective recompute)."""
    sbh = args.seq_length * args.micro_batch_size * args.hidden_size
    memory = sbh * (18 + 4 * (args.ffn_hidden_size / args.hidden_size)) * args.num_layers
    memory += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    memory += sbh * args.pipeline_model_parallel_size
    memory *= _schedule_factor(args, num_microbatches)
    if args.pipeline_model_parallel_size == 1:
        memory += sbh * 4 * (1 + args.padded_vocab_size / args.hidden_size)
    return memory / args.tensor_model_parallel_size


def activation_bytes_without_sp(args: argparse.Namespace, num_microbatches: int | None) -> float:
    """Megatron's `compute_activation_memory_without_sp`."""
    sbh = args.seq_length * args.micro_batch_size * args.hidden_size
    memory = sbh * (10 + 24 / args.tensor_model_parallel_size) * args.num_layers
    memory += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    memory += sbh * args.pipeline_model_parallel_size
    memory *= _schedule_factor(args, num_microbatches)
    if args.pipeline_model_parallel_size == 1:
        logits = (
            args.seq_length * args.micro_batch_size * args.padded_vocab_size / args.tensor_model_parallel_size
        )
        memory += (logits + sbh) * 2
    return memory * 1.05


def theoretical_memory_mb(
    args: argparse.Namespace, num_microbatches: int | None
) -> tuple[float, float, float]:
    """(weight and optimizer, activation, total) in MB, as Megatron's `report_theoretical_memory` computes them."""
    weights = weight_and_optimizer_bytes(args) / NUM_BYTES_IN_MEGABYTE
    if args.sequence_parallel and args.recompute_granularity == "selective":
        activation = activation_bytes_with_sp(args, num_microbatches)
    else:
        activation = activation_bytes_without_sp(args, num_microbatches)
    activation /= NUM_BYTES_IN_MEGABYTE
    return weights, activation, weights + activation


def megatron_line(args: argparse.Namespace, num_microbatches: int | None) -> str:
    weights, activation, total = theoretical_memory_mb(args, num_microbatches)
    return (
        f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB, "
        f"activation={activation:.2f} MB, total={total:.2f} MB"
    )
