"""The GPT family's Hugging Face export: GPT-2 (`GPT2LMHeadModel`) for a learned-position model, else the Llama
family (`LlamaForCausalLM`, `Qwen2ForCausalLM` with q/k/v biases): config.json from our TransformerConfig, the
weights by the tables of `models.hf_import` (docs/architecture.md, converting checkpoints). The `hf` converter
(`convert.hf`) writes the folder and reads these architectures back.
"""

from __future__ import annotations

from typing import Any

from megatron_train.models.config import TransformerConfig
from megatron_train.models.hf_import import (
    EXPORT,
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
    --add-qkv-bias), refusing the settings those architectures lack by their flag."""
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
