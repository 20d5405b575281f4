"""Load a Hugging Face BERT-family checkpoint directory into our BertModel (post-LN layers, one TP rank).

The directory holds `config.json` and the weights (`model.safetensors` or `pytorch_model.bin`) of a
`BertModel`, `BertForMaskedLM` or `BertForPreTraining`. How our parameters relate to Hugging Face's is the BERT
table of `models.hf_import`; the tests prove equal hidden states and MLM logits.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from megatron_train.models.bert import BertModel
from megatron_train.models.config import TransformerConfig
from megatron_train.models.hf_import import (
    EXPORT,
    bert_rules,
    export_checks,
    from_hf,
    hf_gelu,
    refuse_unless,
    to_hf,
)

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
        bias_gelu_fusion=False,  # HF BERT's GELU is one function in the MLP and the head: the exact one or gelu_new
        post_ln=True,
    )


def read_hf_weights(directory: str) -> StateDict:
    """The tensors of a Hugging Face checkpoint directory, under the names it saved them with."""
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
    return weights


def read_hf_bert_weights(directory: str) -> StateDict:
    """A BERT checkpoint's tensors under `BertForPreTraining`'s names (a plain `BertModel`'s get the `bert.`
    prefix), old `gamma`/`beta` norm names renamed."""
    return {hf_bert_name(key): tensor for key, tensor in read_hf_weights(directory).items()}


def hf_bert_name(key: str) -> str:
    """A BERT checkpoint's tensor name as `BertForPreTraining` names it."""
    if not key.startswith(("bert.", "cls.")):
        key = "bert." + key
    if key.endswith((".gamma", ".beta")):
        key = key.rsplit(".", 1)[0] + (".weight" if key.endswith(".gamma") else ".bias")
    return key


def bert_state_dict_from_hf(hf: StateDict, config: TransformerConfig) -> StateDict:
    """Our BertModel names for the Hugging Face tensors present in `hf` (heads only where the checkpoint has
    them), by the BERT table of `models.hf_import`."""
    return from_hf(hf, [rule for rule in bert_rules(config) if all(name in hf for name in rule.hf)])


def load_hf_bert(directory: str, padded_vocab_size: int | None = None) -> LoadedBert:
    """A BertModel (eval mode, fp32) with the weights of the Hugging Face checkpoint in `directory`;
    `padded_vocab_size` adds zero padding rows to the vocabulary (default: none)."""
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} is missing; pass a Hugging Face BERT checkpoint directory")
    with open(config_path, encoding="utf-8") as handle:
        hf_config = json.load(handle)
    config = transformer_config_from_hf(hf_config, config_path)
    weights = bert_state_dict_from_hf(read_hf_bert_weights(directory), config)
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


def _bert_hf_config(model: TransformerConfig) -> dict[str, Any]:
    return {
        "architectures": ["BertForPreTraining" if model.bert_binary_head else "BertForMaskedLM"],
        "model_type": "bert",
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "intermediate_size": model.ffn_hidden_size,
        "max_position_embeddings": model.max_position_embeddings,
        "type_vocab_size": 2 if model.bert_binary_head else 1,
        "hidden_act": hf_gelu(model),
        "layer_norm_eps": model.norm_epsilon,
        "hidden_dropout_prob": model.hidden_dropout,
        "attention_probs_dropout_prob": model.attention_dropout,
        "initializer_range": model.init_method_std,
        "position_embedding_type": "absolute",
    }


def export_bert(model: TransformerConfig, tensors: StateDict) -> tuple[dict[str, Any], StateDict]:
    """BertForPreTraining (with the binary head) or BertForMaskedLM, for a post-LN BertModel."""
    same_gelu = model.gelu_approximate == ("tanh" if model.openai_gelu else "none")  # the LM head's GELU
    refuse_unless(
        export_checks(model, "BERT", post_ln=True) + [
            (same_gelu, "Hugging Face BERT has one GELU for the MLP and the LM head, but this model's MLP uses the "
             "tanh approximation (Megatron's bias-GELU fusion) and its head the exact GELU: train with "
             "--no-bias-gelu-fusion (exact in both) or --openai-gelu (tanh in both)"),
        ],
        EXPORT,
    )  # fmt: skip
    hf_tensors = to_hf(tensors, bert_rules(model, model.bert_binary_head, model.bert_binary_head))
    if not model.bert_binary_head:  # no token types: type 0 adds nothing
        embedding = tensors["embedding.word_embeddings.weight"]
        hf_tensors["bert.embeddings.token_type_embeddings.weight"] = embedding.new_zeros(1, model.hidden_size)
    return _bert_hf_config(model), hf_tensors
