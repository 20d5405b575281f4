"""The hybrid family: pure Mamba-2 and hybrid Mamba-Transformer language models (Megatron's pretrain_hybrid, formerly
pretrain_mamba), one `MambaModel` whose `--hybrid-layer-pattern` lists its layers.

GPT's data, forward step and loss (the GPT datasets; `--reset-attention-mask` documents restart the Mamba layers'
state too; the MoE layers' aux and z losses as GPT's); its own model, terms (the Mamba layers' projections,
convolution and scan, the MoE layers' active parameters), pipeline split (the
pattern's `|` segments), its names in Megatron-LM checkpoints (TransformerEngine's fused norms of Mamba layers
included) and Hugging Face's `Mamba2ForCausalLM` both ways.
"""

from __future__ import annotations

from collections import Counter

from megatron_train.arguments import MegatronConfig
from megatron_train.families.family import (
    HFConversion,
    InferenceHooks,
    Layouts,
    MegatronNames,
    ModelFamily,
    PipelineSplit,
)
from megatron_train.families.gpt import datasets_provider, forward_step
from megatron_train.models.hf_mamba import export_mamba2
from megatron_train.models.hybrid import MambaModel, hybrid_layer_range
from megatron_train.models.hybrid_pattern import ATTENTION, MAMBA, MLP, MOE, layer_symbols
from megatron_train.models.mamba import CONV_KERNEL, check_mamba_config, mamba_shapes
from megatron_train.models.terms import (
    ModelTerms,
    ScanTerm,
    WeightTerm,
    embedding_terms,
    final_norm_terms,
    mlp_terms,
    moe_terms,
    norm_parameters,
    output_layer_terms,
    self_attention_terms,
)

HYBRID_PIPELINE = PipelineSplit(("embedding.",), ("decoder.final_norm.", "output_layer."), hybrid_layer_range)
_NO_VIRTUAL = (
    "a hybrid model's pipeline stages are its --hybrid-layer-pattern segments (cut by |); virtual stages are not "
    "built for it: drop the flag"
)


def check_hybrid_config(config: MegatronConfig) -> None:
    """Megatron's pretrain_hybrid rules, as ValueErrors naming the flag: the Mamba shape must split over TP (and
    TP x CP), and
    the stages are the pattern's segments (without a pattern the model is --num-layers Mamba layers, Megatron's
    pure Mamba), and --num-experts shapes the pattern's E layers, so it needs some."""
    model, parallel = config.model, config.parallel
    if model.is_moe and MOE not in layer_symbols(model.hybrid_layer_pattern, model.num_layers):
        raise ValueError(
            f"--num-experts {model.num_experts}: a hybrid model's MoE layers are the E layers of "
            f"--hybrid-layer-pattern, and {model.hybrid_layer_pattern!r} has none; add E layers or drop --num-experts"
        )
    check_mamba_config(model, parallel.tensor_model_parallel_size, parallel.context_parallel_size)
    hybrid_layer_range(model, 0, parallel.pipeline_model_parallel_size)


def mamba_layer_terms(config: MegatronConfig, layers: int, tokens: int) -> ModelTerms:
    """`layers` Mamba layers (`models.mamba.MambaLayer`: norm, in- and out-projections, depthwise convolution,
    per-head dt_bias, A_log and D, the gated norm) over `tokens` tokens, and their selective scans."""
    model = config.model
    heads, d_inner, bc, conv_channels = mamba_shapes(model)
    projections = model.hidden_size * (2 * d_inner + 2 * bc + heads) + d_inner * model.hidden_size
    weights = (
        WeightTerm("Mamba projections", layers * projections, tokens),
        WeightTerm("Mamba convolution", layers * conv_channels * CONV_KERNEL, tokens),
        WeightTerm(
            "Mamba norms, biases and per-head parameters",
            layers * (norm_parameters(model) + conv_channels + 3 * heads + d_inner),
        ),
    )
    return ModelTerms(weights, scans=(ScanTerm(layers, tokens, d_inner, model.mamba_state_dim),))


def hybrid_terms(config: MegatronConfig, padded_vocab_size: int) -> ModelTerms:
    """Embeddings, the pattern's Mamba, attention, MLP and MoE layers (their experts' active parameters in the
    FLOPs, as GPT's) over --seq-length tokens, the final norm and the output layer."""
    model, seq = config.model, config.model.seq_length
    counts = Counter(layer_symbols(model.hybrid_layer_pattern, model.num_layers))
    terms = (
        embedding_terms(model, padded_vocab_size)
        + mamba_layer_terms(config, counts[MAMBA], seq)
        + self_attention_terms("decoder", model, counts[ATTENTION], seq)
        + mlp_terms("decoder", model, counts[MLP], seq)
        + final_norm_terms("decoder", model)
        + output_layer_terms(model, padded_vocab_size, seq)
    )
    return terms + moe_terms("decoder", model, counts[MOE], seq) if counts[MOE] else terms


HYBRID = ModelFamily(
    name="hybrid",
    model_class=MambaModel,
    terms=hybrid_terms,
    layouts=Layouts(
        frozenset({"tensor", "sequence", "pipeline", "context", "expert"}),
        {"virtual pipeline": _NO_VIRTUAL},
    ),
    pipeline=HYBRID_PIPELINE,
    forward_step=forward_step,
    datasets_provider=datasets_provider,
    per_token_loss=True,
    mixture_of_experts=True,
    check_config=check_hybrid_config,
    entry_module="megatron_train.pretrain_hybrid",
    corpus="document",
    flow_flags=(
        "--hybrid-layer-pattern",
        "M*M-",
        "--position-embedding-type",
        "none",
        "--normalization",
        "RMSNorm",
        "--mamba-state-dim",
        "16",
        "--mamba-head-dim",
        "32",
        "--mamba-num-groups",
        "1",
        "--disable-bias-linear",
    ),  # fmt: skip
    megatron_names=MegatronNames(
        "decoder",
        renames={
            "mixer.in_proj.layer_norm_weight": "norm.weight",  # TransformerEngine's spec fuses the layer's norm
            "mixer.in_proj.layer_norm_bias": "norm.bias",
            "mixer.conv1d_weight": "mixer.conv1d.weight",  # Megatron-Core's newer parameter names
            "mixer.conv1d_bias": "mixer.conv1d.bias",
        },
        torch_dist="Megatron-Core saves Mamba mixers' in-projection as five tensors (z, x, B, C, dt), not mapped "
        "here: convert with --saver megatron (or flow, hf)",
    ),
    hf=HFConversion(("mamba2",), export_mamba2, "AutoModelForCausalLM"),
    inference=InferenceHooks(),
)
