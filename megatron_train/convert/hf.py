"""The `hf` loader and saver: a Hugging Face model folder for GPT-2, the Llama family (Llama-2/3, Mistral,
Qwen2) and BERT (BertForPreTraining with the binary head, BertForMaskedLM without; post-LN, as Hugging Face's).

A folder is config.json, safetensors weights (one `model.safetensors`, or shards listed by
`model.safetensors.index.json`) and the tokenizer's files. The loader reads the model config from config.json,
so the user restates nothing; the saver writes what `transformers` `from_pretrained` loads with no unused or
missing weights, the vocabulary cut to the true vocabulary (docs/architecture.md, checkpoints). The weight
mapping itself is `megatron_train.models.hf_import`'s table of each family.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_train.arguments import MegatronConfig
from megatron_train.convert.weights import (
    TOKEN_ID_KEYS,
    ModelWeights,
    check_tensor_names,
    model_shardings,
    tokenizer_files_in,
)
from megatron_train.data.config import DataConfig
from megatron_train.models.config import TransformerConfig
from megatron_train.models.hf_bert import hf_bert_name, transformer_config_from_hf
from megatron_train.models.hf_import import bert_rules, from_hf, gpt2_rules, llama_rules, to_hf
from storage.atomic import atomic_copy, atomic_path, atomic_write_text

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The Llama family by model_type: whether its attention has q/k/v biases (Qwen2's, Megatron's --add-qkv-bias).
LLAMA_TYPES = {"llama": False, "mistral": False, "qwen2": True}
# Megatron's --use-rope-scaling fixes these of HF's rope_type "llama3"; only --rope-scaling-factor varies.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
DTYPES = {"float32": {}, "bfloat16": {"bf16": True}, "float16": {"fp16": True}}


def _refuse(checks: list[tuple[bool, str]], where: str) -> None:
    for ok, problem in checks:
        if not ok:
            raise ValueError(f"{where}: {problem}")


def _gpt2_config(hf: dict[str, Any], where: str) -> TransformerConfig:
    _refuse(
        [
            (hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu"),
             f"activation_function {hf.get('activation_function')!r} is neither gelu_new nor gelu"),
            (not hf.get("scale_attn_by_inverse_layer_idx") and not hf.get("reorder_and_upcast_attn"),
             "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn change attention; this model has neither"),
        ],
        where,
    )  # fmt: skip
    return TransformerConfig(
        num_layers=hf["n_layer"],
        hidden_size=hf["n_embd"],
        num_attention_heads=hf["n_head"],
        seq_length=hf["n_positions"],
        ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"],
        openai_gelu=hf.get("activation_function", "gelu_new") == "gelu_new",
        norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        hidden_dropout=hf.get("resid_pdrop", 0.1),
        attention_dropout=hf.get("attn_pdrop", 0.1),
        true_vocab_size=hf["vocab_size"],
    )


def _rope_settings(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our rotary flags from HF's rope_parameters (transformers 5) or rope_theta + rope_scaling (before)."""
    rope = hf.get("rope_parameters") or {
        **(hf.get("rope_scaling") or {}),
        "rope_theta": hf.get("rope_theta", 1e4),
    }
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope["rope_theta"]
    _refuse(
        [
            (rope_type in ("default", "llama3"), f"rope_type {rope_type!r} is not one this model has (default, llama3)"),
            (float(theta).is_integer(), f"rope_theta {theta} is not a whole number (--rotary-base)"),
            (rope_type != "llama3" or all(rope.get(k) == v for k, v in LLAMA3_ROPE.items()),
             f"llama3 rope scaling needs {LLAMA3_ROPE} (Megatron's --use-rope-scaling), got {rope}"),
        ],
        where,
    )  # fmt: skip
    settings: dict[str, Any] = {"rotary_base": int(theta)}
    if rope_type == "llama3":
        settings |= {"use_rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
    return settings


def _llama_config(hf: dict[str, Any], where: str) -> TransformerConfig:
    rope = _rope_settings(hf, where)
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    qkv_bias = LLAMA_TYPES[hf["model_type"]]
    # Qwen2 configs carry a sliding_window that only use_sliding_window (or a sliding layer) turns on
    sliding = hf.get("use_sliding_window") if qkv_bias else hf.get("sliding_window") is not None
    _refuse(
        [
            (hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')!r} is not silu (SwiGLU)"),
            (not hf.get("attention_bias") and not hf.get("mlp_bias"), "attention_bias / mlp_bias are not mapped"),
            (not sliding and "sliding_attention" not in (hf.get("layer_types") or []),
             "sliding-window attention is not implemented here"),
        ],
        where,
    )  # fmt: skip
    return TransformerConfig.llama(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        seq_length=hf["max_position_embeddings"],
        ffn_hidden_size=hf["intermediate_size"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        group_query_attention=kv_heads != heads,
        num_query_groups=kv_heads,
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_qkv_bias=qkv_bias,
        true_vocab_size=hf["vocab_size"],
        **rope,
    )


def _json_file(path: str) -> dict[str, Any]:
    """A folder's JSON file (config.json, the weights index) as a dict; a bad one is an error naming it."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({error}); fetch or fix the file") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class SafetensorsFolder(Mapping[str, torch.Tensor]):
    """The tensors of a folder's weights (the shards its index lists, or its one model.safetensors), each read
    when the mapping asks for it: converting holds about one copy of the model, not the source's and ours."""

    def __init__(self, load_dir: str) -> None:
        index_path = os.path.join(load_dir, INDEX_FILE)
        if os.path.exists(index_path):
            files = sorted(set(_json_file(index_path).get("weight_map", {}).values()))
        elif os.path.exists(os.path.join(load_dir, WEIGHTS_FILE)):
            files = [WEIGHTS_FILE]
        else:
            raise ValueError(
                f"{load_dir} has neither {INDEX_FILE} nor {WEIGHTS_FILE}: save the model with transformers' "
                "save_pretrained (safetensors) first"
            )
        self._handles = {}
        for name in files:
            path = os.path.join(load_dir, name)
            try:
                handle = safe_open(path, framework="pt")
            except (OSError, SafetensorError) as error:
                raise ValueError(
                    f"{path} is not a readable safetensors file ({error}): the download or copy is truncated or "
                    "corrupt; fetch the file again"
                ) from error
            self._handles |= dict.fromkeys(handle.keys(), handle)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)


def _bert_tensors(
    model: TransformerConfig, hf: dict[str, Any], where: str, weights: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A BertForPreTraining / BertForMaskedLM folder's tensors for our post-LN BertModel (`model` learns whether
    it has the binary head). Ours has token types only with the binary head (Megatron's pretrain_bert), so a
    masked-LM model's type-0 embedding is added to the position embeddings: the sum the model computes for
    type 0, which is what a masked LM is fed."""
    tensors = {hf_bert_name(name): weights[name] for name in weights}
    if "cls.predictions.transform.dense.weight" not in tensors:
        raise ValueError(
            f"{where}: the weights hold no masked-LM head (a plain BertModel?): the converter carries whole "
            "BertForPreTraining or BertForMaskedLM models"
        )
    model.bert_binary_head = "cls.seq_relationship.weight" in tensors
    token_types = "bert.embeddings.token_type_embeddings.weight"
    if model.bert_binary_head and hf.get("type_vocab_size", 2) != 2:
        raise ValueError(
            f"{where}: type_vocab_size {hf['type_vocab_size']}: the binary head needs 2 token types"
        )
    if not model.bert_binary_head:
        position = "bert.embeddings.position_embeddings.weight"
        tensors[position] = tensors[position] + tensors.pop(token_types)[0]
    return from_hf(tensors, bert_rules(model, model.bert_binary_head, model.bert_binary_head))


def load(load_dir: str) -> ModelWeights:
    """The model in a Hugging Face folder; its config from config.json, its tokenizer files carried along."""
    where = os.path.join(load_dir, CONFIG_FILE)
    hf = _json_file(where)
    model_type = hf.get("model_type")
    families = {
        "gpt2": (_gpt2_config, gpt2_rules),
        **dict.fromkeys(LLAMA_TYPES, (_llama_config, llama_rules)),
        "bert": (transformer_config_from_hf, None),
    }
    if model_type not in families:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not one the hf loader maps (it maps "
            f"{', '.join(sorted(families))}); convert the model from one of those architectures"
        )
    to_config, rules = families[model_type]
    try:
        model = to_config(hf, where)
    except KeyError as error:
        raise ValueError(f"{where} lacks {error}, which a {model_type} config has") from error
    try:
        weights = SafetensorsFolder(load_dir)
        tensors = (
            _bert_tensors(model, hf, where, weights) if rules is None else from_hf(weights, rules(model))
        )
    except KeyError as error:
        raise ValueError(f"{load_dir}: the weights lack {error}, which its {CONFIG_FILE} needs") from error
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    for flag, value in DTYPES.get(dtype, {}).items():
        setattr(model, flag, value)
    config = MegatronConfig(model=model, data=DataConfig())
    kind = "bert" if model_type == "bert" else "gpt"
    check_tensor_names(tensors, list(model_shardings(config, model.true_vocab_size, kind)), load_dir)
    token_ids = {key: hf[key] for key in TOKEN_ID_KEYS if isinstance(hf.get(key), int)}
    return ModelWeights(config, tensors, tokenizer_files_in(load_dir), token_ids=token_ids, model_type=kind)


def _gpt2_hf_config(model: TransformerConfig) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_layer": model.num_layers,
        "n_embd": model.hidden_size,
        "n_head": model.num_attention_heads,
        "n_inner": model.ffn_hidden_size,
        "n_positions": model.max_position_embeddings,
        "activation_function": "gelu_new" if model.openai_gelu else "gelu",
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
        "hidden_act": "gelu_new" if model.openai_gelu else "gelu",
        "layer_norm_eps": model.norm_epsilon,
        "hidden_dropout_prob": model.hidden_dropout,
        "attention_probs_dropout_prob": model.attention_dropout,
        "initializer_range": model.init_method_std,
        "position_embedding_type": "absolute",
    }


def _export(weights: ModelWeights) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF config, HF tensors) of our model, refusing settings the HF architecture lacks by their flag."""
    model = weights.config.model
    common = [
        (not model.apply_layernorm_1p, "--apply-layernorm-1p has no HF equivalent"),
        (model.rotary_percent == 1.0, "--rotary-percent below 1 has no HF Llama equivalent"),
    ]
    where = "--saver hf"
    if model.position_embedding_type == "learned_absolute":
        family = "BERT" if weights.model_type == "bert" else "GPT-2"
        _refuse(
            common + [
                (model.normalization == "LayerNorm" and not model.swiglu and model.add_bias_linear,
                 f"{family} needs LayerNorm, GELU and linear biases (no --swiglu, --normalization RMSNorm, "
                 "--disable-bias-linear)"),
                (not model.untie_embeddings_and_output_weights, f"{family} ties its output layer to the embedding"),
                (model.num_query_groups_effective == model.num_attention_heads,
                 f"{family} has no grouped-query attention"),
                (model.kv_channels * model.num_attention_heads == model.hidden_size, f"{family} needs --kv-channels "
                 "= hidden size / heads"),
                (model.post_ln == (weights.model_type == "bert"), "Hugging Face BERT is post-LN (train with "
                 "--post-ln); GPT-2 is pre-LN"),
            ],
            where,
        )  # fmt: skip
        if weights.model_type == "gpt":
            return _gpt2_hf_config(model), to_hf(weights.tensors, gpt2_rules(model))
        tensors = to_hf(weights.tensors, bert_rules(model, model.bert_binary_head, model.bert_binary_head))
        if not model.bert_binary_head:  # no token types: type 0 adds nothing
            embedding = weights.tensors["embedding.word_embeddings.weight"]
            tensors["bert.embeddings.token_type_embeddings.weight"] = embedding.new_zeros(
                1, model.hidden_size
            )
        return _bert_hf_config(model), tensors
    _refuse(
        common + [
            (model.normalization == "RMSNorm" and model.swiglu and not model.add_bias_linear,
             "Llama and Qwen2 need --normalization RMSNorm, --swiglu and --disable-bias-linear (Qwen2: and "
             "--add-qkv-bias)"),
        ],
        where,
    )  # fmt: skip
    return _llama_hf_config(model), to_hf(weights.tensors, llama_rules(model))


def _shards(tensors: dict[str, torch.Tensor], max_shard_size: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, cut into shards of at most `max_shard_size` bytes (a bigger tensor alone in one)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def save(weights: ModelWeights, save_dir: str, max_shard_size: int = 5 * 10**9) -> str:
    """Write `weights` as a Hugging Face folder (config.json written last); returns `save_dir`."""
    hf_config, tensors = _export(weights)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    # ids the source does not record are written as None: transformers' defaults (GPT-2's 50256) may not exist
    hf_config |= {key: weights.token_ids.get(key) for key in TOKEN_ID_KEYS}
    hf_config |= {"vocab_size": weights.true_vocab_size, "dtype": dtype}
    os.makedirs(save_dir, exist_ok=True)
    shards = _shards(tensors, max_shard_size)
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        name = WEIGHTS_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        with atomic_path(os.path.join(save_dir, name)) as tmp:
            save_file(shard, tmp, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
    if len(shards) > 1:
        total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_text(os.path.join(save_dir, INDEX_FILE), json.dumps(index, indent=2))
    for name, source in weights.tokenizer_files.items():
        atomic_copy(source, os.path.join(save_dir, name))
    atomic_write_text(os.path.join(save_dir, CONFIG_FILE), json.dumps(hf_config, indent=2))
    return save_dir
