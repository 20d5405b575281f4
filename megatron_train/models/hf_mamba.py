"""The hybrid family's Hugging Face architecture: `Mamba2ForCausalLM` (pure Mamba-2: every layer `M`), its
config.json <-> our TransformerConfig and its weight table, which the `hf` converter reads and writes with
(docs/architecture.md, converting checkpoints).

Hugging Face's Mamba-2 layers hold the same tensors as ours, in the same layouts (the in-projection's [z, x, B, C,
dt] rows, the [x, B, C] convolution channels, the group-wise gated norm), so every rule is a rename.
"""

from __future__ import annotations

from typing import Any

from megatron_train.models.config import TransformerConfig
from megatron_train.models.hf_import import (
    EXPORT,
    Rule,
    StateDict,
    export_checks,
    refuse_unless,
    same,
    to_hf,
)
from megatron_train.models.hybrid_pattern import MAMBA, layer_symbols
from megatron_train.models.mamba import CONV_KERNEL, GATED_NORM_EPS, mamba_heads

MIXER_TENSORS = (
    "in_proj.weight",
    "conv1d.weight",
    "conv1d.bias",
    "dt_bias",
    "A_log",
    "D",
    "norm.weight",
    "out_proj.weight",
)
# HF Mamba-2 has no position limit; a converted model generates up to this many tokens (Megatron's examples' 4096).
DEFAULT_SEQ_LENGTH = 4096


def _json_float(value: Any) -> float:
    """A float of config.json; transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def mamba2_config(hf: dict[str, Any], where: str) -> TransformerConfig:
    """Our config of a `Mamba2ForCausalLM` config.json, refusing what our mixer does not have (Megatron-Core's
    mixer: kernel 4, no projection biases, a convolution bias, SiLU, no dt limit, its norms' epsilon 1e-5)."""
    hidden, heads, head_dim = hf["hidden_size"], hf["num_heads"], hf["head_dim"]
    expand, epsilon = hf.get("expand", 2), hf.get("layer_norm_epsilon", 1e-5)
    limit = tuple(_json_float(value) for value in hf.get("time_step_limit") or (0.0, float("inf")))
    refuse_unless(
        [
            (hf.get("conv_kernel", CONV_KERNEL) == CONV_KERNEL, f"conv_kernel {hf.get('conv_kernel')} is not {CONV_KERNEL}"),
            (not hf.get("use_bias", False) and hf.get("use_conv_bias", True),
             "use_bias / use_conv_bias other than False / True are not built (Megatron-Core's mixer)"),
            (hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')!r} is not silu"),
            (limit == (0.0, float("inf")), f"time_step_limit {list(limit)} clamps dt, which this mixer does not"),
            (heads * head_dim == int(expand * hidden), f"num_heads x head_dim ({heads} x {head_dim}) is not "
             f"expand x hidden_size ({expand} x {hidden})"),
            (epsilon == GATED_NORM_EPS, f"layer_norm_epsilon {epsilon}: the mixer's gated norm uses {GATED_NORM_EPS}"),
        ],
        where,
    )  # fmt: skip
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        seq_length=DEFAULT_SEQ_LENGTH,
        position_embedding_type="none",
        normalization="RMSNorm",
        norm_epsilon=epsilon,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mamba_state_dim=hf["state_size"],
        mamba_head_dim=head_dim,
        mamba_num_groups=hf.get("n_groups", 1),
        mamba_num_heads=heads,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        true_vocab_size=hf["vocab_size"],
    )


def mamba2_rules(config: TransformerConfig) -> list[Rule]:
    """`transformers.Mamba2ForCausalLM` (lm_head only when untied)."""
    rules = [same("embedding.word_embeddings.weight", "backbone.embeddings.weight")]
    for i in range(config.num_layers):
        src, dst = f"backbone.layers.{i}.", f"decoder.layers.{i}."
        rules.append(same(dst + "norm.weight", src + "norm.weight"))
        rules += [same(f"{dst}mixer.{name}", f"{src}mixer.{name}") for name in MIXER_TENSORS]
    rules.append(same("decoder.final_norm.weight", "backbone.norm_f.weight"))
    if config.untie_embeddings_and_output_weights:
        rules.append(same("output_layer.weight", "lm_head.weight"))
    return rules


def export_mamba2(model: TransformerConfig, tensors: StateDict) -> tuple[dict[str, Any], StateDict]:
    """Mamba2ForCausalLM, refusing what it lacks by the flag: attention or MLP layers, positions, LayerNorm."""
    pattern, heads = model.hybrid_layer_pattern, mamba_heads(model)
    refuse_unless(
        export_checks(model, "Mamba-2", post_ln=False) + [
            (set(layer_symbols(pattern, model.num_layers)) == {MAMBA}, f"Mamba2ForCausalLM has Mamba layers only, but "
             f"--hybrid-layer-pattern {pattern!r} has others; export a pure Mamba model (all M)"),
            (model.position_embedding_type == "none", "Mamba2ForCausalLM has no position embeddings: train with "
             "--position-embedding-type none"),
            (model.normalization == "RMSNorm", "Mamba2ForCausalLM's norms are RMSNorm: train with --normalization RMSNorm"),
            (model.norm_epsilon == GATED_NORM_EPS, f"Mamba2ForCausalLM uses one epsilon for every norm, the mixer's "
             f"{GATED_NORM_EPS}: train with --norm-epsilon {GATED_NORM_EPS}"),
            (heads * model.mamba_head_dim % model.hidden_size == 0, f"Mamba2ForCausalLM's width is a whole multiple "
             f"(expand) of --hidden-size, not --mamba-num-heads x --mamba-head-dim = {heads * model.mamba_head_dim}"),
        ],
        EXPORT,
    )  # fmt: skip
    config = {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_heads": heads,
        "head_dim": model.mamba_head_dim,
        "expand": heads * model.mamba_head_dim // model.hidden_size,
        "state_size": model.mamba_state_dim,
        "n_groups": model.mamba_num_groups,
        "conv_kernel": CONV_KERNEL,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "layer_norm_epsilon": model.norm_epsilon,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
    }
    return config, to_hf(tensors, mamba2_rules(model))
