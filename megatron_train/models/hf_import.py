"""Hugging Face GPT-2 / Llama state dicts <-> GPTModel state dicts (single TP rank, all layers).

The mapping doubles as the precise statement of how our parameters relate to the two reference
architectures; the tests prove logits equal after loading, both ways. The `hf` converter
(`megatron_train.convert.hf`, docs/architecture.md, checkpoints) reads and writes checkpoints through it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_train.models.config import TransformerConfig
from megatron_train.models.transformer import pack_qkv, unpack_qkv

StateDict = dict[str, torch.Tensor]


def gpt2_state_dict_from_hf(hf: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    """From `transformers.GPT2LMHeadModel.state_dict()` (its Conv1D weights are stored [in, out])."""
    ours = {
        "embedding.word_embeddings.weight": hf["transformer.wte.weight"],
        "embedding.position_embeddings.weight": hf["transformer.wpe.weight"],
        "decoder.final_layernorm.weight": hf["transformer.ln_f.weight"],
        "decoder.final_layernorm.bias": hf["transformer.ln_f.bias"],
    }
    heads = config.num_attention_heads
    for i in range(config.num_layers):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        q, k, v = hf[src + "attn.c_attn.weight"].t().chunk(3)
        q_bias, k_bias, v_bias = hf[src + "attn.c_attn.bias"].chunk(3)
        ours |= {
            dst + "input_layernorm.weight": hf[src + "ln_1.weight"],
            dst + "input_layernorm.bias": hf[src + "ln_1.bias"],
            dst + "self_attention.linear_qkv.weight": pack_qkv(q, k, v, num_query_groups=heads),
            dst + "self_attention.linear_qkv.bias": pack_qkv(q_bias, k_bias, v_bias, num_query_groups=heads),
            dst + "self_attention.linear_proj.weight": hf[src + "attn.c_proj.weight"].t(),
            dst + "self_attention.linear_proj.bias": hf[src + "attn.c_proj.bias"],
            dst + "pre_mlp_layernorm.weight": hf[src + "ln_2.weight"],
            dst + "pre_mlp_layernorm.bias": hf[src + "ln_2.bias"],
            dst + "mlp.linear_fc1.weight": hf[src + "mlp.c_fc.weight"].t(),
            dst + "mlp.linear_fc1.bias": hf[src + "mlp.c_fc.bias"],
            dst + "mlp.linear_fc2.weight": hf[src + "mlp.c_proj.weight"].t(),
            dst + "mlp.linear_fc2.bias": hf[src + "mlp.c_proj.bias"],
        }
    return {name: tensor.contiguous() for name, tensor in ours.items()}


def llama_state_dict_from_hf(hf: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    """From `transformers.LlamaForCausalLM.state_dict()` (rotate-half RoPE convention, as ours)."""
    ours = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if config.untie_embeddings_and_output_weights:
        ours["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (hf[src + f"self_attn.{name}_proj.weight"] for name in "qkv")
        ours |= {
            dst + "input_layernorm.weight": hf[src + "input_layernorm.weight"],
            dst + "self_attention.linear_qkv.weight": pack_qkv(q, k, v, config.num_query_groups_effective),
            dst + "self_attention.linear_proj.weight": hf[src + "self_attn.o_proj.weight"],
            dst + "pre_mlp_layernorm.weight": hf[src + "post_attention_layernorm.weight"],
            dst + "mlp.linear_fc1.weight": torch.cat(
                (hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"])
            ),
            dst + "mlp.linear_fc2.weight": hf[src + "mlp.down_proj.weight"],
        }
    return {name: tensor.contiguous() for name, tensor in ours.items()}


def gpt2_state_dict_to_hf(ours: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    """Inverse of `gpt2_state_dict_from_hf`: `GPT2LMHeadModel` names (its lm_head is the tied wte)."""
    hf = {
        "transformer.wte.weight": ours["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": ours["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": ours["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": ours["decoder.final_layernorm.bias"],
    }
    heads = config.num_attention_heads
    for i in range(config.num_layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        qkv = unpack_qkv(ours[src + "self_attention.linear_qkv.weight"], heads, heads)
        qkv_bias = unpack_qkv(ours[src + "self_attention.linear_qkv.bias"], heads, heads)
        hf |= {
            dst + "ln_1.weight": ours[src + "input_layernorm.weight"],
            dst + "ln_1.bias": ours[src + "input_layernorm.bias"],
            dst + "attn.c_attn.weight": torch.cat(qkv).t(),
            dst + "attn.c_attn.bias": torch.cat(qkv_bias),
            dst + "attn.c_proj.weight": ours[src + "self_attention.linear_proj.weight"].t(),
            dst + "attn.c_proj.bias": ours[src + "self_attention.linear_proj.bias"],
            dst + "ln_2.weight": ours[src + "pre_mlp_layernorm.weight"],
            dst + "ln_2.bias": ours[src + "pre_mlp_layernorm.bias"],
            dst + "mlp.c_fc.weight": ours[src + "mlp.linear_fc1.weight"].t(),
            dst + "mlp.c_fc.bias": ours[src + "mlp.linear_fc1.bias"],
            dst + "mlp.c_proj.weight": ours[src + "mlp.linear_fc2.weight"].t(),
            dst + "mlp.c_proj.bias": ours[src + "mlp.linear_fc2.bias"],
        }
    return {name: tensor.contiguous() for name, tensor in hf.items()}


def llama_state_dict_to_hf(ours: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    """Inverse of `llama_state_dict_from_hf`: `LlamaForCausalLM` names (lm_head only when untied)."""
    hf = {
        "model.embed_tokens.weight": ours["embedding.word_embeddings.weight"],
        "model.norm.weight": ours["decoder.final_layernorm.weight"],
    }
    if config.untie_embeddings_and_output_weights:
        hf["lm_head.weight"] = ours["output_layer.weight"]
    for i in range(config.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = unpack_qkv(
            ours[src + "self_attention.linear_qkv.weight"],
            config.num_query_groups_effective,
            config.num_attention_heads,
        )
        gate, up = ours[src + "mlp.linear_fc1.weight"].chunk(2)
        hf |= {
            dst + "input_layernorm.weight": ours[src + "input_layernorm.weight"],
            dst + "self_attn.q_proj.weight": q,
            dst + "self_attn.k_proj.weight": k,
            dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": ours[src + "self_attention.linear_proj.weight"],
            dst + "post_attention_layernorm.weight": ours[src + "pre_mlp_layernorm.weight"],
            dst + "mlp.gate_proj.weight": gate,
            dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": ours[src + "mlp.linear_fc2.weight"],
        }
    return {name: tensor.contiguous() for name, tensor in hf.items()}
