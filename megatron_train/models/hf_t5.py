"""Load a Hugging Face T5 v1.0 checkpoint directory (`T5ForConditionalGeneration`) into our T5Model, exactly.

Where the architectures coincide the weights copy: RMSNorm pre-norm layers without biases, T5's relative
position bias (Hugging Face keeps it in the first layer of each stack and reuses it in every layer, as ours
does per block), ReLU MLP, tied embeddings. Three documented deltas are folded into the copied weights, so the
logits are equal (tests/test_hf_t5.py):

- Hugging Face's attention scores are q k^T without 1 / sqrt(d_kv) (T5's init absorbs it); ours scale, so
  every query projection is multiplied by sqrt(d_kv);
- with tied embeddings Hugging Face scales the decoder output by d_model**-0.5 before the LM head; the
  decoder's final norm weight is multiplied by it (the norm's output is linear in its weight);
- Megatron's LM head has a bias, Hugging Face's none: it is zero.

T5 v1.1 / Flan-T5 (gated-GELU MLP, untied head) use an MLP this engine does not build and are refused.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_train.models.config import TransformerConfig
from megatron_train.models.hf_bert import StateDict, read_hf_weights
from megatron_train.models.t5 import T5Model
from megatron_train.models.transformer import pack_qkv

REQUIRED_CONFIG_KEYS = ("num_layers", "d_model", "d_kv", "d_ff", "num_heads", "vocab_size")


def transformer_config_from_hf_t5(hf_config: dict, where: str = "config.json") -> TransformerConfig:
    """Our TransformerConfig for a Hugging Face T5Config dict (T5 v1.0's architecture)."""
    missing = [key for key in REQUIRED_CONFIG_KEYS if key not in hf_config]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}; is this a Hugging Face T5 config?")
    feed_forward = hf_config.get("feed_forward_proj", "relu")
    if feed_forward != "relu":
        raise ValueError(
            f"{where}: feed_forward_proj {feed_forward!r} (T5 v1.1 / Flan-T5's gated MLP) is not built here; "
            "T5 v1.0 checkpoints (feed_forward_proj 'relu', e.g. t5-small) load"
        )
    seq_length = hf_config.get("n_positions", 512)
    return TransformerConfig(
        num_layers=hf_config["num_layers"],
        decoder_num_layers=hf_config.get("num_decoder_layers") or hf_config["num_layers"],
        hidden_size=hf_config["d_model"],
        num_attention_heads=hf_config["num_heads"],
        kv_channels=hf_config["d_kv"],
        ffn_hidden_size=hf_config["d_ff"],
        seq_length=seq_length,
        decoder_seq_length=seq_length,
        position_embedding_type="relative",
        relative_attention_num_buckets=hf_config.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf_config.get("relative_attention_max_distance", 128),
        true_vocab_size=hf_config["vocab_size"],
        normalization="RMSNorm",
        norm_epsilon=hf_config.get("layer_norm_epsilon", 1e-6),
        activation_func="relu",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not hf_config.get("tie_word_embeddings", True),
        hidden_dropout=hf_config.get("dropout_rate", 0.1),
        attention_dropout=hf_config.get("dropout_rate", 0.1),
    )


def _attention(hf: StateDict, src: str, config: TransformerConfig) -> tuple[torch.Tensor, ...]:
    """(q, k, v, o) of one attention, q multiplied by sqrt(d_kv) (the first delta)."""
    q, k, v, o = (hf[f"{src}.{name}.weight"] for name in ("q", "k", "v", "o"))
    return q * config.kv_channels**0.5, k, v, o


def _fused_kv(k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """CrossAttention's linear_kv rows: per head, its key rows then its value rows."""
    width = k.shape[1]
    return torch.cat((k.view(num_heads, -1, width), v.view(num_heads, -1, width)), dim=1).reshape(-1, width)


def t5_state_dict_from_hf(hf: StateDict, config: TransformerConfig) -> StateDict:
    """Our T5Model names for a Hugging Face T5ForConditionalGeneration state dict, deltas folded in."""
    ours = {
        "embedding.word_embeddings.weight": hf["shared.weight"],
        "encoder_relative_position.weight": hf[
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        ],
        "decoder_relative_position.weight": hf[
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        ],
        "encoder.final_layernorm.weight": hf["encoder.final_layer_norm.weight"],
        "decoder.final_layernorm.weight": hf["decoder.final_layer_norm.weight"],
        "output_layer.bias": torch.zeros(hf["shared.weight"].shape[0]),
    }
    if config.untie_embeddings_and_output_weights:
        ours["output_layer.weight"] = hf["lm_head.weight"]
    else:  # the second delta: Hugging Face's d_model**-0.5 before its tied LM head
        ours["decoder.final_layernorm.weight"] = (
            ours["decoder.final_layernorm.weight"] * config.hidden_size**-0.5
        )
    for stack, num_layers in (("encoder", config.num_layers), ("decoder", config.num_decoder_layers)):
        mlp_sublayer = 1 if stack == "encoder" else 2
        for i in range(num_layers):
            src, dst = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
            q, k, v, o = _attention(hf, f"{src}0.SelfAttention", config)
            ours |= {
                dst + "input_layernorm.weight": hf[f"{src}0.layer_norm.weight"],
                dst + "self_attention.linear_qkv.weight": pack_qkv(q, k, v, config.num_attention_heads),
                dst + "self_attention.linear_proj.weight": o,
                dst + "pre_mlp_layernorm.weight": hf[f"{src}{mlp_sublayer}.layer_norm.weight"],
                dst + "mlp.linear_fc1.weight": hf[f"{src}{mlp_sublayer}.DenseReluDense.wi.weight"],
                dst + "mlp.linear_fc2.weight": hf[f"{src}{mlp_sublayer}.DenseReluDense.wo.weight"],
            }
            if stack == "decoder":
                q, k, v, o = _attention(hf, f"{src}1.EncDecAttention", config)
                ours |= {
                    dst + "pre_cross_attn_layernorm.weight": hf[f"{src}1.layer_norm.weight"],
                    dst + "cross_attention.linear_q.weight": q,
                    dst + "cross_attention.linear_kv.weight": _fused_kv(k, v, config.num_attention_heads),
                    dst + "cross_attention.linear_proj.weight": o,
                }
    return {name: tensor.contiguous() for name, tensor in ours.items()}


def load_hf_t5(directory: str) -> tuple[T5Model, TransformerConfig]:
    """A T5Model (eval mode, fp32, one TP rank) with the weights of the Hugging Face T5 v1.0 checkpoint in
    `directory` (`config.json` and `model.safetensors` or `pytorch_model.bin`)."""
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} is missing; pass a Hugging Face T5 checkpoint directory")
    with open(config_path, encoding="utf-8") as handle:
        config = transformer_config_from_hf_t5(json.load(handle), config_path)
    hf = read_hf_weights(directory)
    try:
        weights = t5_state_dict_from_hf(hf, config)
    except KeyError as error:
        raise ValueError(
            f"{directory}: the checkpoint lacks {error}, which a T5 model of its config has"
        ) from None
    model = T5Model(config, config.true_vocab_size)
    model.load_state_dict(weights, strict=True)
    return model.eval(), config
