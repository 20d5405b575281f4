"""The `hf` loader and saver: a Hugging Face model folder for GPT-2, the Llama family (Llama-2/3, Mistral,
Qwen2), its mixtures of experts (Mixtral, Qwen2-MoE), BERT (BertForPreTraining with the binary head, BertForMaskedLM without; post-LN, as Hugging Face's).

A folder is config.json, safetensors weights (one `model.safetensors`, or shards listed by
`model.safetensors.index.json`) and the tokenizer's files. The loader reads the model config from config.json,
so the user restates nothing; the saver writes what `transformers` `from_pretrained` loads with no unused or
missing weights, the vocabulary cut to the true vocabulary (docs/architecture.md, checkpoints). The weight
mapping itself is `megatron_train.models.hf_import`'s table of each family.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing.files import save_safetensors
from megatron_train.convert.checks import check_dims, check_fields, check_layers, check_shapes, describe_type
from megatron_train.convert.source import inside, member, read_json_object
from megatron_train.convert.target import output_folder
from megatron_train.convert.tokenizer_files import read_hf_tokenizer, write_hf_tokenizer
from megatron_train.convert.weights import (
    TOKEN_ID_KEYS,
    ModelWeights,
    check_tensor_names,
    model_shapes,
    model_shardings,
)
from megatron_train.data.config import DataConfig
from megatron_train.families.family import ModelFamily
from megatron_train.families.registry import hf_family
from megatron_train.models.config import TransformerConfig
from megatron_train.models.hf_bert import hf_bert_name, transformer_config_from_hf
from megatron_train.models.hf_gpt import LLAMA3_ROPE, LLAMA_TYPES, MOE_TYPES
from megatron_train.models.hf_import import (
    Rule,
    bert_rules,
    from_hf,
    gpt2_rules,
    llama_rules,
    refuse_unless,
    to_hf,
)
from megatron_train.models.hf_mamba import mamba2_config, mamba2_rules
from megatron_train.models.moe.config import pattern_text
from storage.atomic import atomic_path, atomic_write_text

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": {}, "bfloat16": {"bf16": True}, "float16": {"fp16": True}}
# A safetensors header's dtype -> torch's name (float64 weights convert as they are and run as float32)
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
# Tensors a folder may hold beyond the model's weights: buffers older transformers saved, BERT's tied MLM decoder.
IGNORED_HF_TENSORS = re.compile(
    r"(\.attn\.(masked_)?bias|position_ids|rotary_emb\.inv_freq|^cls\.predictions\.decoder\.(weight|bias))$"
)


# Our TransformerConfig fields -> the config.json keys they are read from, per family; the checks name these keys.
GPT2_FIELDS = {
    "num_layers": "n_layer",
    "hidden_size": "n_embd",
    "num_attention_heads": "n_head",
    "seq_length": "n_positions",
    "true_vocab_size": "vocab_size",
    "ffn_hidden_size": "n_inner",
    "norm_epsilon": "layer_norm_epsilon",
    "hidden_dropout": "resid_pdrop",
    "attention_dropout": "attn_pdrop",
}
LLAMA_FIELDS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "seq_length": "max_position_embeddings",
    "ffn_hidden_size": "intermediate_size",
    "true_vocab_size": "vocab_size",
    "kv_channels": "head_dim",
    "num_query_groups": "num_key_value_heads",
    "norm_epsilon": "rms_norm_eps",
}
BERT_FIELDS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "ffn_hidden_size": "intermediate_size",
    "seq_length": "max_position_embeddings",
    "true_vocab_size": "vocab_size",
    "norm_epsilon": "layer_norm_eps",
    "hidden_dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "init_method_std": "initializer_range",
}
MAMBA2_FIELDS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "true_vocab_size": "vocab_size",
    "norm_epsilon": "layer_norm_epsilon",
    "mamba_state_dim": "state_size",
    "mamba_head_dim": "head_dim",
    "mamba_num_groups": "n_groups",
    "mamba_num_heads": "num_heads",
}
MIXTRAL_FIELDS = LLAMA_FIELDS | {
    "num_experts": "num_local_experts",
    "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "intermediate_size",
}
QWEN2_MOE_FIELDS = LLAMA_FIELDS | {
    "num_experts": "num_experts",
    "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
}
FIELD_NAMES = {
    "gpt2": GPT2_FIELDS,
    **dict.fromkeys(LLAMA_TYPES, LLAMA_FIELDS),
    "mixtral": MIXTRAL_FIELDS,
    "qwen2_moe": QWEN2_MOE_FIELDS,
    "bert": BERT_FIELDS,
    "mamba2": MAMBA2_FIELDS,
}
# Other keys the readers use, and what they must be.
HF_KEY_TYPES: dict[str, Any] = {
    "activation_function": str,
    "hidden_act": str,
    "model_type": str,
    "tie_word_embeddings": bool,
    "use_sliding_window": bool,
    "type_vocab_size": int,
    "rope_theta": float,
    "rope_parameters": dict,
    "rope_scaling": dict,
    "dtype": str,
    "torch_dtype": str,
    "layer_types": list,
    "qkv_bias": bool,
    "norm_topk_prob": bool,
    "decoder_sparse_step": int,
    "mlp_only_layers": list,
    "router_aux_loss_coef": float,
    "router_jitter_noise": float,
}


def check_hf_config(hf: dict[str, Any], model_type: str, where: str) -> None:
    """config.json's sizes and settings have their types and sane values (names as config.json spells them),
    before anything is built from them."""
    fields = FIELD_NAMES[model_type]
    values = {ours: hf[key] for ours, key in fields.items() if hf.get(key) is not None}
    check_fields(values, TransformerConfig, where, names=fields)
    for key, kind in HF_KEY_TYPES.items():
        if key in hf and not _has_type(hf[key], kind):
            raise ValueError(f"{where}: {key} is {hf[key]!r}, not {describe_type(kind)}")
    heads, hidden = values.get("num_attention_heads"), values.get("hidden_size")
    if heads is None or hidden is None:
        return  # the family's reader names the missing key
    if values.get("kv_channels") is None and hidden % heads:
        raise ValueError(
            f"{where}: {fields['hidden_size']} {hidden} is not divisible by {fields['num_attention_heads']} {heads}"
        )
    kv_heads = values.get("num_query_groups", heads)
    if heads % kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )


def _gpt2_config(hf: dict[str, Any], where: str) -> TransformerConfig:
    refuse_unless(
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
        bias_gelu_fusion=False,  # "gelu" is the exact GELU
        norm_epsilon=_or(hf, "layer_norm_epsilon", 1e-5),
        hidden_dropout=_or(hf, "resid_pdrop", 0.1),
        attention_dropout=_or(hf, "attn_pdrop", 0.1),
        true_vocab_size=hf["vocab_size"],
    )


def _or(hf: dict[str, Any], key: str, default: Any) -> Any:
    """hf[key], or `default` where it is absent or null."""
    value = hf.get(key)
    return default if value is None else value


def _rope_settings(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our rotary flags from HF's rope_parameters (transformers 5) or rope_theta + rope_scaling (before)."""
    rope = hf.get("rope_parameters") or {
        **(hf.get("rope_scaling") or {}),
        "rope_theta": _or(hf, "rope_theta", 1e4),
    }
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta, factor = rope.get("rope_theta"), rope.get("factor", 8.0)
    refuse_unless(
        [
            (rope_type in ("default", "llama3"), f"rope_type {rope_type!r} is not one this model has (default, llama3)"),
            (_is_number(theta) and theta >= 1 and float(theta).is_integer(),
             f"rope_theta {theta!r} is not a whole number of at least 1 (--rotary-base)"),
            (rope_type != "llama3" or all(rope.get(k) == v for k, v in LLAMA3_ROPE.items()),
             f"llama3 rope scaling needs {LLAMA3_ROPE} (Megatron's --use-rope-scaling), got {rope}"),
            (rope_type != "llama3" or (_is_number(factor) and factor > 0),
             f"rope factor {factor!r} is not a positive number"),
        ],
        where,
    )  # fmt: skip
    settings: dict[str, Any] = {"rotary_base": int(theta)}
    if rope_type == "llama3":
        settings |= {"use_rope_scaling": True, "rope_scaling_factor": float(factor)}
    return settings


def _has_type(value: Any, kind: type) -> bool:
    if kind is float:
        return _is_number(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _llama_config(hf: dict[str, Any], where: str, **moe: Any) -> TransformerConfig:
    """A Llama-family config.json's model (`moe`: the MoE settings of Mixtral's or Qwen2-MoE's)."""
    rope = _rope_settings(hf, where)
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    qkv_bias = hf.get("qkv_bias", LLAMA_TYPES.get(hf["model_type"], hf["model_type"] == "qwen2_moe"))
    # Qwen2 configs carry a sliding_window that only use_sliding_window (or a sliding layer) turns on
    sliding = hf.get("use_sliding_window") if qkv_bias else hf.get("sliding_window") is not None
    refuse_unless(
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
        norm_epsilon=_or(hf, "rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_qkv_bias=qkv_bias,
        true_vocab_size=hf["vocab_size"],
        **rope,
        **moe,
    )


def _aux_loss(hf: dict[str, Any]) -> dict[str, Any]:
    """HF's load-balancing loss coefficient as Megatron's aux_loss (what training a converted model uses)."""
    return {
        "moe_router_load_balancing_type": ["aux_loss"],
        "moe_aux_loss_coeff": [hf.get("router_aux_loss_coef", 0.0)],
    }


def _mixtral_config(hf: dict[str, Any], where: str) -> TransformerConfig:
    """MixtralForCausalLM: every layer MoE, top-k of the router's softmax renormalised (Megatron's default
    softmax over the top k logits)."""
    refuse_unless(
        [(not hf.get("router_jitter_noise"), f"router_jitter_noise {hf.get('router_jitter_noise')} (noise on the "
          "router's input in training) is not implemented here")],
        where,
    )  # fmt: skip
    return _llama_config(
        hf,
        where,
        num_experts=hf["num_local_experts"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"],
        **_aux_loss(hf),
    )


def _qwen2_moe_config(hf: dict[str, Any], where: str) -> TransformerConfig:
    """Qwen2MoeForCausalLM: MoE layers every decoder_sparse_step-th layer but mlp_only_layers (dense MLPs of
    intermediate_size), top-k of the softmax kept as is (--moe-router-pre-softmax) unless norm_topk_prob, a shared
    expert with a sigmoid gate (--moe-shared-expert-gate)."""
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = hf.get("mlp_only_layers") or []
    refuse_unless(
        [(step >= 1, f"decoder_sparse_step {step} is not at least 1"),
         (all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in dense),
          f"mlp_only_layers {dense!r:.80} are not layer numbers below num_hidden_layers {layers}")],
        where,
    )  # fmt: skip
    pattern = [int(hf["num_experts"] > 0 and i not in dense and (i + 1) % step == 0) for i in range(layers)]
    shared = hf.get("shared_expert_intermediate_size")
    refuse_unless([(bool(shared), f"shared_expert_intermediate_size {shared}: Qwen2-MoE's shared expert is mapped "
                    "only with a size > 0")], where)  # fmt: skip
    if not any(pattern):
        return _llama_config(hf, where)
    return _llama_config(
        hf,
        where,
        num_experts=hf["num_experts"],
        moe_layer_freq=pattern_text(pattern),
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=True,
        **_aux_loss(hf),
    )


class SafetensorsFolder(Mapping[str, torch.Tensor]):
    """The tensors of a folder's weights (the shards its index lists, or its one model.safetensors), each read
    when the mapping asks for it: converting holds about one copy of the model, not the source's and ours.
    Opening reads only the files' headers (each checked to be a regular file inside the folder, its header
    size bounded by the file's), so the tensors' names, shapes and dtypes are known before any is read."""

    def __init__(self, load_dir: str) -> None:
        index_path = os.path.join(load_dir, INDEX_FILE)
        if os.path.lexists(index_path):
            files = _indexed_files(load_dir, index_path)
        elif os.path.lexists(os.path.join(load_dir, WEIGHTS_FILE)):
            files = [WEIGHTS_FILE]
        else:
            raise ValueError(
                f"{load_dir} has neither {INDEX_FILE} nor {WEIGHTS_FILE}: save the model with transformers' "
                "save_pretrained (safetensors) first"
            )
        self._handles = {}
        self.files: dict[str, str] = {}  # tensor name -> file name
        for name in files:
            path = member(load_dir, name, "a weights file")
            try:
                _check_header_size(path)
                handle = safe_open(path, framework="pt")
            except (OSError, SafetensorError) as error:
                raise ValueError(
                    f"{path} is not a readable safetensors file ({error}): the download or copy is truncated or "
                    "corrupt; fetch the file again"
                ) from error
            for key in handle.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                if key in self._handles:
                    raise ValueError(
                        f"{path}: tensor {key!r} is also in {self.files[key]}; one file per tensor"
                    )
                self._handles[key], self.files[key] = handle, name

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from its file's header (nothing read)."""
        return tuple(self._handles[name].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """A tensor's dtype as the header names it (F32, BF16, F16, ...)."""
        return self._handles[name].get_slice(name).get_dtype()


def _indexed_files(load_dir: str, index_path: str) -> list[str]:
    """The file names a weights index maps tensors to, each a plain file name of the folder."""
    index = read_json_object(member(load_dir, INDEX_FILE, "the weights index"))
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(
            f"{index_path}: no weight_map object (tensor name -> file name); fetch the file again"
        )
    names = sorted(set(weight_map.values()), key=str)
    for name in names:
        member(load_dir, name, f"{INDEX_FILE}'s weight_map")
    return names


def _check_header_size(path: str) -> None:
    """A safetensors file starts with the 8-byte size of its JSON header: it must fit in the file and in
    MAX_HEADER_BYTES, or the file is not safetensors (checked before the header is read)."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        prefix = handle.read(8)
    header = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 < header <= min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(
            f"{path} is not a readable safetensors file (its header size field says {header} bytes in a file of "
            f"{size}): the download or copy is truncated or corrupt; fetch the file again"
        )


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


def load(load_dir: str, model_family: str | None = None) -> ModelWeights:
    """The model in a Hugging Face folder, as the model family whose architectures include config.json's
    `model_type` (`ModelFamily.hf`; the project's, or the one `model_family` names); its config from config.json,
    checked against the weights' headers before a tensor is read; its tokenizer carried along
    (`convert.tokenizer_files`). The readers below are the architectures' tables."""
    where = os.path.join(load_dir, CONFIG_FILE)
    # a null value means "the default" for every key read here: dropped, so each reader sees it absent
    hf = {k: v for k, v in read_json_object(inside(load_dir, where, CONFIG_FILE)).items() if v is not None}
    model_type = hf.get("model_type")
    readers = {
        "gpt2": (_gpt2_config, gpt2_rules),
        **dict.fromkeys(LLAMA_TYPES, (_llama_config, llama_rules)),
        "mixtral": (_mixtral_config, lambda config: llama_rules(config, MOE_TYPES["mixtral"])),
        "qwen2_moe": (_qwen2_moe_config, lambda config: llama_rules(config, MOE_TYPES["qwen2_moe"])),
        "bert": (transformer_config_from_hf, None),
        "mamba2": (mamba2_config, mamba2_rules),
    }
    if not isinstance(model_type, str) or model_type not in readers:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not one the hf loader maps (it maps "
            f"{', '.join(sorted(readers))}); convert the model from one of those architectures"
        )
    family = hf_family(model_type, where, model_family)
    check_hf_config(hf, model_type, where)
    to_config, rules = readers[model_type]
    try:
        model = to_config(hf, where)
    except KeyError as error:
        raise ValueError(f"{where} lacks {error}, which a {model_type} config has") from error
    except ValueError as error:  # the config's own rules name our flags: say which file they come from
        if str(error).startswith(where):
            raise
        raise ValueError(f"{where}: {error}") from error
    weights = SafetensorsFolder(load_dir)
    if rules is None:  # BERT: which heads the folder holds decide the model
        model.bert_binary_head = "cls.seq_relationship.weight" in {hf_bert_name(name) for name in weights}
        binary = model.bert_binary_head
        rules = lambda config: bert_rules(config, binary, binary)  # noqa: E731
    for flag, value in _checked_dtype(weights, hf, where, load_dir).items():
        setattr(model, flag, value)
    config = MegatronConfig(model=model, data=DataConfig())
    _check_against_weights(config, hf, model_type, family, rules, weights, where, load_dir)
    tensors = (
        _bert_tensors(model, hf, where, weights) if model_type == "bert" else from_hf(weights, rules(model))
    )
    check_tensor_names(tensors, list(model_shardings(config, model.true_vocab_size, family)), load_dir)
    config.tokenizer, tokenizer_files = read_hf_tokenizer(load_dir)
    return ModelWeights(
        config,
        tensors,
        tokenizer_files,
        token_ids=_token_ids(hf, model.true_vocab_size, where),
        family=family,
    )


def _checked_dtype(
    weights: SafetensorsFolder, hf: dict[str, Any], where: str, load_dir: str
) -> dict[str, bool]:
    """Our precision flags from the weights' one floating dtype (the tensors decide; a config.json that says
    otherwise gets a warning); integer or mixed dtypes are refused."""
    dtypes: dict[str, str] = {}
    for name in weights:
        dtypes.setdefault(weights.dtype(name), name)
    if len(dtypes) != 1 or not set(dtypes) <= set(SAFETENSORS_DTYPES):
        found = ", ".join(f"{dtype} ({name})" for dtype, name in dtypes.items())
        raise ValueError(
            f"{load_dir}: the weights hold tensors of {found}; a model's weights are of one floating dtype "
            f"({', '.join(SAFETENSORS_DTYPES)})"
        )
    dtype = SAFETENSORS_DTYPES[next(iter(dtypes))]
    claimed = hf.get("dtype", hf.get("torch_dtype"))
    if claimed is not None and claimed != dtype and not (claimed == "float32" and dtype == "float64"):
        logger.warning(
            "%s: dtype %r, but the weights are %s: they are converted as they are", where, claimed, dtype
        )
    return DTYPES.get(dtype, {})


def _check_against_weights(
    config: MegatronConfig,
    hf: dict[str, Any],
    model_type: str,
    family: ModelFamily,
    rules: Callable[[TransformerConfig], list[Rule]],
    weights: SafetensorsFolder,
    where: str,
    load_dir: str,
) -> None:
    """config.json's sizes against the weights' headers, before the model is built (even on the meta device)
    or a tensor read: the layer count, the vocabulary, hidden size and positions of the embeddings, then every
    tensor's shape against those the config implies."""
    model, fields = config.model, FIELD_NAMES[model_type]
    names = {hf_bert_name(name) if model_type == "bert" else name: name for name in weights}
    shapes = {ours: weights.shape(name) for ours, name in names.items()}
    source = f"the weights of {load_dir}"
    # one layer's table (an MoE model's: of an MoE layer, its --moe-layer-freq pattern fits no one-layer model)
    one_layer_model = dataclasses.replace(model, num_layers=1, moe_layer_freq="1")
    one_layer = {rule.ours: rule.hf for rule in rules(one_layer_model)}
    layer_name = next(name for hf_names in one_layer.values() for name in hf_names if ".0." in name)
    check_layers(model.num_layers, shapes, layer_name[: layer_name.index(".0.") + 1], fields["num_layers"],
                 where, source)  # fmt: skip
    dims = {
        "embedding.word_embeddings.weight": {0: (fields["true_vocab_size"], model.true_vocab_size),
                                             1: (fields["hidden_size"], model.hidden_size)},
        "embedding.position_embeddings.weight": {0: (fields.get("seq_length"), model.max_position_embeddings)},
    }  # fmt: skip
    for ours, checks in dims.items():
        name = one_layer.get(ours, ("",))[0]
        if name in shapes:
            check_dims(shapes[name], checks, name, where, source)
    meta = {
        name: torch.empty(shape, device="meta")
        for name, shape in model_shapes(config, model.true_vocab_size, family, where).items()
    }
    expected = {name: tuple(tensor.shape) for name, tensor in to_hf(meta, rules(model)).items()}
    if (
        model_type == "bert" and not model.bert_binary_head
    ):  # a masked LM's token types are folded into positions
        token_types = "bert.embeddings.token_type_embeddings.weight"
        expected[token_types] = (shapes.get(token_types, (1,))[0] or 1, model.hidden_size)
    sizes = ", ".join(f"{key} {hf[key]}" for key in fields.values() if key in hf)
    check_shapes(shapes, expected, sizes, where, source)
    unused = sorted(name for name in set(shapes) - set(expected) if not IGNORED_HF_TENSORS.search(name))
    embedding = one_layer["embedding.word_embeddings.weight"][0]
    if "lm_head.weight" in unused and torch.equal(
        weights[names["lm_head.weight"]], weights[names[embedding]]
    ):
        unused.remove("lm_head.weight")  # a tied output layer saved anyway: the embedding itself
    if "lm_head.weight" in unused:
        raise ValueError(
            f"{where}: tie_word_embeddings is {hf.get('tie_word_embeddings', False)!r}, but {source} hold an "
            "lm_head.weight of their own; set tie_word_embeddings to false"
        )
    if unused:
        raise ValueError(
            f"{source} hold {len(unused)} tensor(s) the model {where} describes ({sizes}) has no place for "
            f"({', '.join(unused[:3])}); the config and the weights come from different models"
        )


def _token_ids(hf: dict[str, Any], vocab_size: int, where: str) -> dict[str, int]:
    """bos/eos/pad ids config.json gives within the vocabulary; one outside it is dropped with a warning (a
    transformers default such as GPT-2's 50256 left in a smaller model's config)."""
    token_ids = {}
    for key in TOKEN_ID_KEYS:
        value = hf.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
            token_ids[key] = value
        elif value is not None:
            logger.warning("%s: %s %r is not a token id of the %d-token vocabulary: ignored", where, key, value,
                           vocab_size)  # fmt: skip
    return token_ids


def _export(weights: ModelWeights) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF config, HF tensors) of our model by its family's export, which refuses a setting the HF architecture
    lacks by its flag."""
    family = weights.family
    if family.hf is None:
        raise ValueError(
            f"--saver hf: the {family.name} family has no Hugging Face mapping; pick another --saver"
        )
    return family.hf.export(weights.config.model, weights.tensors)


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


def save(
    weights: ModelWeights, save_dir: str, max_shard_size: int = 5 * 10**9, overwrite: bool = False
) -> str:
    """Write `weights` as a Hugging Face folder (config.json written last), built beside `save_dir` and moved
    into place whole (`convert.target`); returns `save_dir`."""
    if not (isinstance(max_shard_size, int) and max_shard_size >= 1):
        raise ValueError(f"--max-shard-size is {max_shard_size!r}; it must be a positive number of bytes")
    hf_config, tensors = _export(weights)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    # ids the source does not record are written as None: transformers' defaults (GPT-2's 50256) may not exist
    hf_config |= {key: weights.token_ids.get(key) for key in TOKEN_ID_KEYS}
    hf_config |= {"vocab_size": weights.true_vocab_size, "dtype": dtype}
    shards = _shards(tensors, max_shard_size)
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    with output_folder(save_dir, overwrite, total) as out:
        weight_map = {}
        for number, shard in enumerate(shards, start=1):
            name = (
                WEIGHTS_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            )
            with atomic_path(os.path.join(out, name)) as tmp:
                save_safetensors(shard, tmp, {"format": "pt"})
            weight_map |= dict.fromkeys(shard, name)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            atomic_write_text(os.path.join(out, INDEX_FILE), json.dumps(index, indent=2))
        write_hf_tokenizer(weights.config.tokenizer, weights.tokenizer_files, out)
        atomic_write_text(os.path.join(out, CONFIG_FILE), json.dumps(hf_config, indent=2))
    return save_dir
