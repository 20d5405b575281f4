"""Hugging Face GPT-2 / Llama / Qwen2 / BERT state dicts <-> ours (one TP rank, all layers): a table per family.

A table is a list of `Rule`s, each one of our tensors and the Hugging Face tensors it is made of, with the two
directions of the conversion side by side; `from_hf` and `to_hf` apply a table either way. The tables are the
precise statement of how our parameters relate to the reference architectures; the tests prove logits equal
after loading, both ways. The `hf` converter (`megatron_train.convert.hf`, docs/architecture.md, checkpoints)
and `models.hf_bert` read and write checkpoints through them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from megatron_train.models.config import TransformerConfig
from megatron_train.models.transformer import pack_qkv, unpack_qkv

StateDict = dict[str, torch.Tensor]


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _one(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (tensor,)


@dataclass(frozen=True)
class Rule:
    """Our tensor `ours` is `to_ours(*hf tensors)`; the other way, `to_hf(ours)` gives the `hf` tensors."""

    ours: str
    hf: tuple[str, ...]
    to_ours: Callable[..., torch.Tensor] = _same
    to_hf: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] = _one


def same(ours: str, hf: str) -> Rule:
    return Rule(ours, (hf,))


def transposed(ours: str, hf: str) -> Rule:
    """GPT-2's Conv1D stores its weight [in, out], a Linear's transpose."""
    return Rule(ours, (hf,), lambda t: t.t(), lambda t: (t.t(),))


def fused_qkv(ours: str, hf: tuple[str, str, str], groups: int, heads: int) -> Rule:
    """Our grouped linear_qkv from separate q, k, v projections (weights or biases)."""
    return Rule(ours, hf, lambda q, k, v: pack_qkv(q, k, v, groups), lambda t: unpack_qkv(t, groups, heads))


def from_hf(hf: Mapping[str, torch.Tensor], rules: list[Rule]) -> StateDict:
    """Our state dict from Hugging Face tensors (a missing one raises KeyError naming it)."""
    return {rule.ours: rule.to_ours(*(hf[name] for name in rule.hf)).contiguous() for rule in rules}


def to_hf(ours: Mapping[str, torch.Tensor], rules: list[Rule]) -> StateDict:
    """Hugging Face tensors from our state dict."""
    hf = {}
    for rule in rules:
        hf |= {
            name: tensor.contiguous()
            for name, tensor in zip(rule.hf, rule.to_hf(ours[rule.ours]), strict=True)
        }
    return hf


def _gpt2_qkv(ours: str, hf: str, heads: int) -> Rule:
    """GPT-2's c_attn: q, k, v side by side in one Conv1D (weight [in, 3 * out], bias [3 * out])."""
    weight = hf.endswith(".weight")

    def to_ours(fused: torch.Tensor) -> torch.Tensor:
        return pack_qkv(*(fused.t() if weight else fused).chunk(3), heads)

    def to_hf(qkv: torch.Tensor) -> tuple[torch.Tensor]:
        fused = torch.cat(unpack_qkv(qkv, heads, heads))
        return (fused.t() if weight else fused,)

    return Rule(ours, (hf,), to_ours, to_hf)


def gpt2_rules(config: TransformerConfig) -> list[Rule]:
    """`transformers.GPT2LMHeadModel` (its lm_head is the tied wte; c_attn is q, k, v side by side)."""
    heads = config.num_attention_heads
    rules = [
        same("embedding.word_embeddings.weight", "transformer.wte.weight"),
        same("embedding.position_embeddings.weight", "transformer.wpe.weight"),
    ]
    for i in range(config.num_layers):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        rules += [
            same(dst + "input_layernorm.weight", src + "ln_1.weight"),
            same(dst + "input_layernorm.bias", src + "ln_1.bias"),
            _gpt2_qkv(dst + "self_attention.linear_qkv.weight", src + "attn.c_attn.weight", heads),
            _gpt2_qkv(dst + "self_attention.linear_qkv.bias", src + "attn.c_attn.bias", heads),
            transposed(dst + "self_attention.linear_proj.weight", src + "attn.c_proj.weight"),
            same(dst + "self_attention.linear_proj.bias", src + "attn.c_proj.bias"),
            same(dst + "pre_mlp_layernorm.weight", src + "ln_2.weight"),
            same(dst + "pre_mlp_layernorm.bias", src + "ln_2.bias"),
            transposed(dst + "mlp.linear_fc1.weight", src + "mlp.c_fc.weight"),
            same(dst + "mlp.linear_fc1.bias", src + "mlp.c_fc.bias"),
            transposed(dst + "mlp.linear_fc2.weight", src + "mlp.c_proj.weight"),
            same(dst + "mlp.linear_fc2.bias", src + "mlp.c_proj.bias"),
        ]  # fmt: skip
    return rules + [
        same("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
        same("decoder.final_layernorm.bias", "transformer.ln_f.bias"),
    ]


def gated_mlp_rules(
    ours: str, hf: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
) -> list[Rule]:
    """Our SwiGLU MLP under `ours` (fc1 = [gate; up], fc2) from HF's gate, up and down projections under `hf`."""
    gate, up, down = (f"{hf}{name}.weight" for name in names)
    return [
        Rule(ours + "linear_fc1.weight", (gate, up), lambda g, u: torch.cat((g, u)), lambda t: t.chunk(2)),
        same(ours + "linear_fc2.weight", down),
    ]


@dataclass(frozen=True)
class MoENames:
    """Where an HF MoE architecture keeps an MoE layer's parts, under `model.layers.<i>.`: the router, an expert
    (`expert` formatted with its index) and its gate, up and down projections, and (Qwen2-MoE) the shared expert
    and its sigmoid gate."""

    router: str
    expert: str
    projections: tuple[str, str, str]
    shared_expert: str | None = None
    shared_gate: str | None = None


MIXTRAL_MOE = MoENames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.", ("w1", "w3", "w2"))
QWEN2_MOE = MoENames(
    "mlp.gate.weight", "mlp.experts.{}.", ("gate_proj", "up_proj", "down_proj"), "mlp.shared_expert.",
    "mlp.shared_expert_gate.weight",
)  # fmt: skip


def moe_layer_rules(config: TransformerConfig, src: str, dst: str, names: MoENames) -> list[Rule]:
    """An MoE layer's router, experts and shared experts: our experts' [experts, h, 2 ffn] fc1 (each [gate | up]
    transposed) and [experts, ffn, h] fc2 from every expert's HF projections."""
    experts, ffn = config.num_experts, config.moe_ffn_hidden_size
    gate, up, down = (
        tuple(f"{src}{names.expert.format(e)}{name}.weight" for e in range(experts))
        for name in names.projections
    )

    def weight1(*tensors: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [torch.cat((g, u)).t() for g, u in zip(tensors[:experts], tensors[experts:], strict=True)]
        )

    rules = [
        same(dst + "mlp.router.weight", src + names.router),
        Rule(
            dst + "mlp.experts.weight1",
            gate + up,
            weight1,
            lambda w: (
                tuple(w[..., :ffn].transpose(1, 2).unbind(0)) + tuple(w[..., ffn:].transpose(1, 2).unbind(0))
            ),
        ),
        Rule(
            dst + "mlp.experts.weight2",
            down,
            lambda *tensors: torch.stack([d.t() for d in tensors]),
            lambda w: tuple(w.transpose(1, 2).unbind(0)),
        ),
    ]
    if config.moe_shared_expert_intermediate_size is not None:
        rules += gated_mlp_rules(dst + "mlp.shared_experts.", src + names.shared_expert)
        rules.append(same(dst + "mlp.shared_experts.gate_weight", src + names.shared_gate))
    return rules


def llama_rules(config: TransformerConfig, moe: MoENames | None = None) -> list[Rule]:
    """`transformers.LlamaForCausalLM` (rotate-half RoPE convention, as ours; lm_head only when untied), and
    `Qwen2ForCausalLM`, the same with q/k/v biases (--add-qkv-bias); with `moe`, Mixtral's or Qwen2-MoE's MoE
    layers where --moe-layer-freq puts them."""
    groups, heads = config.num_query_groups_effective, config.num_attention_heads
    kinds = ("weight", "bias") if config.add_qkv_bias else ("weight",)
    rules = [same("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        rules.append(same(dst + "input_layernorm.weight", src + "input_layernorm.weight"))
        for kind in kinds:
            qkv = tuple(f"{src}self_attn.{name}_proj.{kind}" for name in "qkv")
            rules.append(fused_qkv(f"{dst}self_attention.linear_qkv.{kind}", qkv, groups, heads))
        rules += [
            same(dst + "self_attention.linear_proj.weight", src + "self_attn.o_proj.weight"),
            same(dst + "pre_mlp_layernorm.weight", src + "post_attention_layernorm.weight"),
        ]
        if config.is_moe_layer(i):
            rules += moe_layer_rules(config, src, dst, moe)
        else:
            rules += gated_mlp_rules(dst + "mlp.", src + "mlp.")
    rules.append(same("decoder.final_layernorm.weight", "model.norm.weight"))

    if config.untie_embeddings_and_output_weights:
        rules.append(same("output_layer.weight", "lm_head.weight"))
    return rules


def bert_rules(config: TransformerConfig, token_types: bool = True, binary_head: bool = True) -> list[Rule]:
    """`transformers.BertForPreTraining` (`BertForMaskedLM`: no pooler, no seq_relationship) and our post-LN
    BertModel; the MLM decoder weight is the tied word embedding in both."""
    heads = config.num_attention_heads
    rules = [
        same("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
        same("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
        same("embedding.layernorm.weight", "bert.embeddings.LayerNorm.weight"),
        same("embedding.layernorm.bias", "bert.embeddings.LayerNorm.bias"),
    ]
    if token_types:
        rules.append(
            same("embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight")
        )
    for i in range(config.num_layers):
        src, dst = f"bert.encoder.layer.{i}.", f"encoder.layers.{i}."
        for kind in ("weight", "bias"):
            qkv = tuple(f"{src}attention.self.{name}.{kind}" for name in ("query", "key", "value"))
            rules += [
                fused_qkv(f"{dst}self_attention.linear_qkv.{kind}", qkv, heads, heads),
                same(f"{dst}self_attention.linear_proj.{kind}", f"{src}attention.output.dense.{kind}"),
                same(f"{dst}post_attention_layernorm.{kind}", f"{src}attention.output.LayerNorm.{kind}"),
                same(f"{dst}mlp.linear_fc1.{kind}", f"{src}intermediate.dense.{kind}"),
                same(f"{dst}mlp.linear_fc2.{kind}", f"{src}output.dense.{kind}"),
                same(f"{dst}post_mlp_layernorm.{kind}", f"{src}output.LayerNorm.{kind}"),
            ]
    for kind in ("weight", "bias"):
        rules += [
            same(f"lm_head.dense.{kind}", f"cls.predictions.transform.dense.{kind}"),
            same(f"lm_head.layer_norm.{kind}", f"cls.predictions.transform.LayerNorm.{kind}"),
        ]
    rules.append(same("output_layer.bias", "cls.predictions.bias"))
    if binary_head:
        for kind in ("weight", "bias"):
            rules += [
                same(f"pooler.dense.{kind}", f"bert.pooler.dense.{kind}"),
                same(f"binary_head.{kind}", f"cls.seq_relationship.{kind}"),
            ]
    return rules


def refuse_unless(checks: list[tuple[bool, str]], where: str) -> None:
    """Raise ValueError `<where>: <problem>` for the first check that fails."""
    for ok, problem in checks:
        if not ok:
            raise ValueError(f"{where}: {problem}")


EXPORT = "--saver hf"  # where an export's refusals come from


def hf_gelu(model: TransformerConfig) -> str:
    """HF's name of the MLP's GELU: gelu_new is the tanh approximation (--openai-gelu, Megatron's bias-GELU fusion)."""
    return "gelu_new" if model.gelu_approximate == "tanh" else "gelu"


def export_checks(model: TransformerConfig, architecture: str, post_ln: bool) -> list[tuple[bool, str]]:
    """What every export needs, and for a learned-position model (`architecture` GPT-2 or BERT) what those
    architectures have: LayerNorm, GELU, biases, a tied output layer, no grouped-query attention, and the layer
    order (`post_ln`: BERT's)."""
    checks = [
        (not model.apply_layernorm_1p, "--apply-layernorm-1p has no HF equivalent"),
        (model.rotary_percent == 1.0, "--rotary-percent below 1 has no HF Llama equivalent"),
    ]
    if model.position_embedding_type != "learned_absolute":
        return checks
    return checks + [
        (model.normalization == "LayerNorm" and not model.swiglu and model.add_bias_linear,
         f"{architecture} needs LayerNorm, GELU and linear biases (no --swiglu, --normalization RMSNorm, "
         "--disable-bias-linear)"),
        (not model.untie_embeddings_and_output_weights, f"{architecture} ties its output layer to the embedding"),
        (model.num_query_groups_effective == model.num_attention_heads,
         f"{architecture} has no grouped-query attention"),
        (model.kv_channels * model.num_attention_heads == model.hidden_size, f"{architecture} needs --kv-channels "
         "= hidden size / heads"),
        (model.post_ln == post_ln, "Hugging Face BERT is post-LN (train with --post-ln); GPT-2 is pre-LN"),
    ]  # fmt: skip


def gpt2_state_dict_from_hf(hf: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    """From `transformers.GPT2LMHeadModel.state_dict()`."""
    return from_hf(hf, gpt2_rules(config))


def llama_state_dict_from_hf(hf: Mapping[str, torch.Tensor], config: TransformerConfig) -> StateDict:
    """From `transformers.LlamaForCausalLM.state_dict()`."""
    return from_hf(hf, llama_rules(config))
