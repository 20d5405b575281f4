"""The tiny model the tests build: one shape for every test, in a module rather than a pytest fixture so that
spawned worker processes (`tests/helpers/distributed.py`) import the same definition (docs/architecture.md, tests)."""

from __future__ import annotations

from typing import Any

from megatron_train.models.config import TransformerConfig

# A 2-layer GPT-2 style model without dropout, so runs compare exactly.
TINY_MODEL: dict[str, Any] = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
# What makes it a Llama: grouped-query attention (8 heads, 4 groups), RoPE, RMSNorm, SwiGLU, untied output layer.
TINY_LLAMA: dict[str, Any] = dict(
    TINY_MODEL, num_attention_heads=8, group_query_attention=True, num_query_groups=4, ffn_hidden_size=64,
    swiglu=True, position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)  # fmt: skip


def tiny_config(**overrides: Any) -> TransformerConfig:
    """The tiny GPT's config with `overrides` (e.g. `seq_length=64`) applied."""
    return TransformerConfig(**{**TINY_MODEL, **overrides})


def tiny_llama_config(**overrides: Any) -> TransformerConfig:
    """The tiny Llama's config with `overrides` applied."""
    return TransformerConfig(**{**TINY_LLAMA, **overrides})
