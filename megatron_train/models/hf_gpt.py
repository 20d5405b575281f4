"""The GPT family's Hugging Face export: GPT-2 (`GPT2LMHeadModel`) for a learned-position model, else the Llama
family (`LlamaForCausalLM`, `Qwen2ForCausalLM` with q/k/v biases), an MoE model as Mixtral (`MixtralForCausalLM`)
or, with shared experts, Qwen2-MoE (`Qwen2MoeForCausalLM`): config.json from our TransformerConfig, the weights by
the tables of `models.hf_import` (docs/architecture.md, converting checkpoints). The `hf` converter (`convert.hf`)
writes the folder and reads these architectures back.
"""

from __future__ import annotations

from typing import Any

from megatron_train.models.config import TransformerConfig
from megatron_train.models.hf_import import (
    EXPORT,
    MIXTRAL_MOE,
    QWEN2_MOE,
    StateDict,
    export_checks,
    gpt2_rules,
    hf_gelu,
    llama_rules,
    refuse_unless,
    to_hf,
)

# The Llama family by model_type: whether its attention has q/k/v biases (Qwen2's, Megatron's --add-qkv-bias).
LLAMA_TYPES = {"llama": False, "mistral": False, "qwen2": True}
# Its MoE members (Mixtral, Qwen2-MoE) and where they keep an MoE layer's router and experts.
MOE_TYPES = {"mixtral": MIXTRAL_MOE, "qwen2_moe": QWEN2_MOE}
# Megatron's --use-rope-scaling fixes these of HF's rope_type "llama3"; only --rope-scaling-factor varies.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _gpt2_hf_config(model: TransformerConfig) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_layer": model.num_layers,
        "n_embd": model.hidden_size,
        "n_head": model.num_attention_heads,
        "n_inner": model.ffn_hidden_size,
        "n_positions": model.max_position_embeddings,
        "activation_function": hf_gelu(model),
        "layer_norm_epsilon": model.norm_epsilon,
        "resid_pdrop": model.hidden_dropout,
        "embd_pdrop": model.hidden_dropout,
        "attn_pdrop": model.attention_dropout,
        "tie_word_embeddings": True,
    }


def _llama_hf_config(model: TransformerConfig) -> dict[str, Any]:
    """LlamaForCausalLM, or Qwen2ForCausalLM for a model with q/k/v biases (--add-qkv-bias)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(model.rotary_base)}
    if model.use_rope_scaling:
        rope |= {"rope_type": "llama3", "factor": model.rope_scaling_factor, **LLAMA3_ROPE}
    family = (
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False}
        if model.add_qkv_bias
        else {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
              "mlp_bias": False}
    )  # fmt: skip
    return {
        **family,
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups_effective,
        "head_dim": model.kv_channels,
        "intermediate_size": model.ffn_hidden_size,
        "max_position_embeddings": model.seq_length or model.max_position_embeddings,
        "rms_norm_eps": model.norm_epsilon,
        "hidden_act": "silu",
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "rope_parameters": rope,
    }


def export_gpt(model: TransformerConfig, tensors: StateDict) -> tuple[dict[str, Any], StateDict]:
    """GPT2LMHeadModel for a learned-position model, else LlamaForCausalLM (Qwen2ForCausalLM with
    --add-qkv-bias; an MoE model: `_export_moe`), refusing the settings those architectures lack by their flag."""
    if model.is_moe:
        return _export_moe(model, tensors)
    if model.position_embedding_type == "learned_absolute":
        refuse_unless(export_checks(model, "GPT-2", post_ln=False), EXPORT)
        return _gpt2_hf_config(model), to_hf(tensors, gpt2_rules(model))
    refuse_unless(
        export_checks(model, "Llama", post_ln=False) + [
            (model.position_embedding_type == "rope", "Llama and Qwen2 need --position-embedding-type rope"),
            (model.normalization == "RMSNorm" and model.swiglu and not model.add_bias_linear,
             "Llama and Qwen2 need --normalization RMSNorm, --swiglu and --disable-bias-linear (Qwen2: and "
             "--add-qkv-bias)"),
        ],
        EXPORT,
    )  # fmt: skip
    return _llama_hf_config(model), to_hf(tensors, llama_rules(model))


def _export_moe(model: TransformerConfig, tensors: StateDict) -> tuple[dict[str, Any], StateDict]:
    """Qwen2MoeForCausalLM for a model with (gated) shared experts, else MixtralForCausalLM, refusing what they
    lack by its flag."""
    qwen = model.moe_shared_expert_intermediate_size is not None
    pattern = model.moe_layer_pattern
    checks = export_checks(model, "Mixtral", post_ln=False) + [
        (model.normalization == "RMSNorm" and model.swiglu and not model.add_bias_linear,
         "Mixtral and Qwen2-MoE need --normalization RMSNorm, --swiglu and --disable-bias-linear"),
        (model.moe_router_score_function == "softmax" and not model.moe_router_topk_scaling_factor
         and model.moe_router_num_groups is None and not model.moe_router_enable_expert_bias
         and model.moe_router_load_balancing_type != ["sinkhorn"],
         "Mixtral's and Qwen2-MoE's routers are a softmax's top k: no --moe-router-score-function sigmoid, "
         "--moe-router-topk-scaling-factor, group-limited routing, expert bias or sinkhorn"),
    ]  # fmt: skip
    if qwen:
        checks.append(
            (model.moe_shared_expert_gate, "Qwen2-MoE gates its shared expert: --moe-shared-expert-gate")
        )
    else:
        checks += [
            (
                all(pattern),
                "Mixtral has no dense layers: --moe-layer-freq 1 (or shared experts, as Qwen2-MoE)",
            ),
            (not model.add_qkv_bias, "Mixtral has no q/k/v biases (with shared experts Qwen2-MoE has)"),
            (
                not model.moe_router_pre_softmax,
                "Mixtral renormalises the top k weights: drop --moe-router-pre-softmax",
            ),
        ]
    refuse_unless(checks, EXPORT)
    coeffs = dict(zip(model.moe_router_load_balancing_type, model.moe_aux_loss_coeff, strict=True))
    common = _llama_hf_config(model) | {
        "num_experts_per_tok": model.moe_router_topk,
        "router_aux_loss_coef": coeffs.get("aux_loss", 0.0),
        "output_router_logits": False,
    }
    if qwen:
        config = common | {
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "qkv_bias": model.add_qkv_bias,
            "num_experts": model.num_experts,
            "moe_intermediate_size": model.moe_ffn_hidden_size,
            "shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
            "norm_topk_prob": not model.moe_router_pre_softmax,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe],
        }
        return config, to_hf(tensors, llama_rules(model, QWEN2_MOE))
    config = common | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": model.num_experts,
        "intermediate_size": model.moe_ffn_hidden_size,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        config.pop(key, None)
    return config, to_hf(tensors, llama_rules(model, MIXTRAL_MOE))
