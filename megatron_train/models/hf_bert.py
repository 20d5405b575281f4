"""Load a Hugging Face BERT-family checkpoint directory into our BertModel (post-LN layers, one TP rank).

The directory holds `config.json` and the weights (`model.safetensors` or `pytorch_model.bin`) of a
`BertModel`, `BertForMaskedLM` or `BertForPreTraining`. The name mapping below is the precise statement of how
our parameters relate to Hugging Face's; the tests prove equal hidden states and MLM logits.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from megatron_train.models.bert import BertModel
from megatron_train.models.config import TransformerConfig
from megatron_train.models.transformer import pack_qkv

StateDict = dict[str, torch.Tensor]
REQUIRED_CONFIG_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "vocab_size",
)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass
class LoadedBert:
    """The model, its config, and the parts the checkpoint did not hold (left at their initialisation: a
    plain `BertModel` checkpoint has no LM head, only `BertForPreTraining` has the binary head)."""

    model: BertModel
    config: TransformerConfig
    missing: list[str]


def transformer_config_from_hf(hf_config: dict, where: str = "config.json") -> TransformerConfig:
    """Our TransformerConfig for a Hugging Face BertConfig dict (the original post-LN BERT layer)."""
    missing = [key for key in REQUIRED_CONFIG_KEYS if key not in hf_config]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}; is this a Hugging Face BERT config?")
    activation = hf_config.get("hidden_act", "gelu")
    if activation not in ("gelu", "gelu_new"):
        raise ValueError(f"{where}: hidden_act {activation!r} is not supported; BERT uses 'gelu'")
    if hf_config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{where}: position_embedding_type must be 'absolute' for BertModel")
    return TransformerConfig(
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        num_attention_heads=hf_config["num_attention_heads"],
        ffn_hidden_size=hf_config["intermediate_size"],
        seq_length=hf_config["max_position_embeddings"],
        max_position_embeddings=hf_config["max_position_embeddings"],
        true_vocab_size=hf_config["vocab_size"],
        norm_epsilon=hf_config.get("layer_norm_eps", 1e-12),
        hidden_dropout=hf_config.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf_config.get("attention_probs_dropout_prob", 0.1),
        init_method_std=hf_config.get("initializer_range", 0.02),
        openai_gelu=activation == "gelu_new",
        post_ln=True,
    )


def read_hf_weights(directory: str) -> StateDict:
    """The checkpoint's tensors, `bert.` prefix removed and old `gamma`/`beta` norm names renamed."""
    for name in WEIGHT_FILES:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            break
    else:
        raise FileNotFoundError(
            f"{directory}: no {' or '.join(WEIGHT_FILES)}; pass a Hugging Face checkpoint directory"
        )
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        weights = load_file(path)
    else:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    renamed = {}
    for key, tensor in weights.items():
        key = key.removeprefix("bert.")
        if key.endswith(".gamma") or key.endswith(".beta"):
            key = key.rsplit(".", 1)[0] + (".weight" if key.endswith(".gamma") else ".bias")
        renamed[key] = tensor
    return renamed


def bert_state_dict_from_hf(hf: StateDict, config: TransformerConfig) -> StateDict:
    """Our BertModel names for the Hugging Face tensors present in `hf` (heads only where the checkpoint has
    them). Output layer weight: tied to the word embedding, as in Hugging Face."""
    pairs = {
        "embeddings.word_embeddings.weight": "embedding.word_embeddings.weight",
        "embeddings.position_embeddings.weight": "embedding.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight": "embedding.tokentype_embeddings.weight",
        "embeddings.LayerNorm.weight": "embedding.layernorm.weight",
        "embeddings.LayerNorm.bias": "embedding.layernorm.bias",
        "pooler.dense.weight": "pooler.dense.weight",
        "pooler.dense.bias": "pooler.dense.bias",
        "cls.predictions.transform.dense.weight": "lm_head.dense.weight",
        "cls.predictions.transform.dense.bias": "lm_head.dense.bias",
        "cls.predictions.transform.LayerNorm.weight": "lm_head.layer_norm.weight",
        "cls.predictions.transform.LayerNorm.bias": "lm_head.layer_norm.bias",
        "cls.predictions.bias": "output_layer.bias",
        "cls.seq_relationship.weight": "binary_head.weight",
        "cls.seq_relationship.bias": "binary_head.bias",
    }
    for i in range(config.num_layers):
        src, dst = f"encoder.layer.{i}.", f"encoder.layers.{i}."
        pairs |= {
            src + "attention.output.dense.weight": dst + "self_attention.linear_proj.weight",
            src + "attention.output.dense.bias": dst + "self_attention.linear_proj.bias",
            src + "attention.output.LayerNorm.weight": dst + "post_attention_layernorm.weight",
            src + "attention.output.LayerNorm.bias": dst + "post_attention_layernorm.bias",
            src + "intermediate.dense.weight": dst + "mlp.linear_fc1.weight",
            src + "intermediate.dense.bias": dst + "mlp.linear_fc1.bias",
            src + "output.dense.weight": dst + "mlp.linear_fc2.weight",
            src + "output.dense.bias": dst + "mlp.linear_fc2.bias",
            src + "output.LayerNorm.weight": dst + "post_mlp_layernorm.weight",
            src + "output.LayerNorm.bias": dst + "post_mlp_layernorm.bias",
        }
    ours = {dst: hf[src] for src, dst in pairs.items() if src in hf}
    heads = config.num_attention_heads
    for i in range(config.num_layers):
        src, dst = f"encoder.layer.{i}.attention.self.", f"encoder.layers.{i}.self_attention.linear_qkv."
        for kind in ("weight", "bias"):
            q, k, v = (hf[f"{src}{name}.{kind}"] for name in ("query", "key", "value"))
            ours[dst + kind] = pack_qkv(q, k, v, num_query_groups=heads)
    return {name: tensor.contiguous() for name, tensor in ours.items()}


def load_hf_bert(directory: str, padded_vocab_size: int | None = None) -> LoadedBert:
    """A BertModel (eval mode, fp32) with the weights of the Hugging Face checkpoint in `directory`;
    `padded_vocab_size` adds zero padding rows to the vocabulary (default: none)."""
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} is missing; pass a Hugging Face BERT checkpoint directory")
    with open(config_path, encoding="utf-8") as handle:
        hf_config = json.load(handle)
    config = transformer_config_from_hf(hf_config, config_path)
    weights = bert_state_dict_from_hf(read_hf_weights(directory), config)
    vocab_size = padded_vocab_size or config.true_vocab_size
    model = BertModel(
        config,
        vocab_size,
        num_tokentypes=hf_config.get("type_vocab_size", 2),
        add_binary_head="pooler.dense.weight" in weights,
    )
    for name in ("embedding.word_embeddings.weight", "output_layer.bias"):
        if name in weights and weights[name].shape[0] < vocab_size:
            tensor = weights[name]
            weights[name] = torch.cat(
                (tensor, tensor.new_zeros(vocab_size - tensor.shape[0], *tensor.shape[1:]))
            )
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{directory}: tensors with no place in BertModel: {result.unexpected_keys}")
    return LoadedBert(model.eval(), config, sorted(result.missing_keys))
