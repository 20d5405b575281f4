"""A model's parameters and FLOPs as terms: every weight counted once, with how many of a sample's tokens it
multiplies, and every attention's query and key lengths.

Each model family states its model as `ModelTerms` (`ModelFamily.terms`): the logs' TFLOP/s and MFU are
computed from them (`training.flops`), and their parameter count equals the built model's, every bias, norm,
position embedding and tied copy included (tested per family), which is what a memory planner needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_train.models.config import TransformerConfig


@dataclass(frozen=True)
class WeightTerm:
    """`count` parameters of one kind (`name`), each multiplying `tokens` of a sample's tokens in a forward pass
    (0 for weights looked up or added, never multiplied: embeddings, norms, biases). `stored=False`: weights of
    another term used again (a tied output layer), multiplied but not stored twice."""

    name: str
    count: int
    tokens: float = 0  # an MoE expert's weights multiply top k / experts of the tokens, on average
    stored: bool = True


@dataclass(frozen=True)
class AttentionTerm:
    """`layers` attentions of `queries` query tokens over `keys` key tokens each, `width` (heads x kv channels)
    wide."""

    layers: int
    queries: int
    keys: int
    width: int


@dataclass(frozen=True)
class ScanTerm:
    """`layers` Mamba selective scans over `tokens` tokens, each `width` (heads x head dim) channels with a state
    of `state_dim` per channel."""

    layers: int
    tokens: int
    width: int
    state_dim: int


@dataclass(frozen=True)
class ModelTerms:
    """A model's weights, attentions and selective scans for one sample (of the family's sequence lengths)."""

    weights: tuple[WeightTerm, ...]
    attention: tuple[AttentionTerm, ...] = ()
    scans: tuple[ScanTerm, ...] = ()

    def num_parameters(self) -> int:
        """Every stored parameter of the whole model (the padded vocabulary's rows included)."""
        return sum(term.count for term in self.weights if term.stored)

    def flops_per_sample(self) -> float:
        """Forward + backward FLOPs of one sample (Megatron's `num_floating_point_operations`: the backward counts
        twice the forward): 2 per multiply-add of a weight with a token, 4 x queries x keys x width per attention
        (scores and their weighted sum), causal attention counted in full as Megatron does, and Megatron's 7 x
        tokens x width x state per selective scan."""
        matmuls = sum(term.count * term.tokens for term in self.weights)
        attention = sum(a.layers * a.queries * a.keys * a.width for a in self.attention)
        scans = sum(scan.layers * scan.tokens * scan.width * scan.state_dim for scan in self.scans)
        return 3 * (2 * matmuls + 4 * attention + 7 * scans)

    def __add__(self, other: ModelTerms) -> ModelTerms:
        return ModelTerms(
            self.weights + other.weights, self.attention + other.attention, self.scans + other.scans
        )


def norm_parameters(config: TransformerConfig) -> int:
    """One norm layer's parameters: LayerNorm's weight and bias, RMSNorm's weight."""
    return config.hidden_size * (1 if config.normalization == "RMSNorm" else 2)


def attention_width(config: TransformerConfig) -> int:
    return config.num_attention_heads * config.kv_channels


def layer_stack_terms(
    name: str,
    config: TransformerConfig,
    num_layers: int,
    tokens: int,
    final_norm: bool,
    keys: int | None = None,
) -> ModelTerms:
    """`num_layers` transformer layers (`transformer.TransformerLayer`: self-attention and MLP with their norms)
    over `tokens` tokens, each query attending to `keys` of them (default all: one sequence; causal attention is
    counted in full, as Megatron does), and a final norm when `final_norm`. A layer's cross-attention is
    `cross_attention_terms`. The MoE layers (--moe-layer-freq of a GPT with --num-experts) hold `moe_terms`
    instead of an MLP."""
    moe_layers = sum(config.moe_layer_pattern) if config.is_moe else 0
    terms = self_attention_terms(name, config, num_layers, tokens, keys) + mlp_terms(
        name, config, num_layers - moe_layers, tokens
    )
    if moe_layers:
        terms += moe_terms(name, config, moe_layers, tokens)
    return terms + final_norm_terms(name, config) if final_norm else terms


def self_attention_terms(
    name: str, config: TransformerConfig, layers: int, tokens: int, keys: int | None = None
) -> ModelTerms:
    """`layers` self-attentions with the norm before each (`transformer.SelfAttention`), over `tokens` tokens,
    each query attending to `keys` of them (default all)."""
    hidden, width, kv_width = config.hidden_size, attention_width(config), _kv_width(config)
    qkv_bias = width + 2 * kv_width if config.add_bias_linear or config.add_qkv_bias else 0
    biases = qkv_bias + (hidden if config.add_bias_linear else 0)
    weights = (
        WeightTerm(
            f"{name} attention weights", layers * (hidden * (width + 2 * kv_width) + width * hidden), tokens
        ),
        WeightTerm(f"{name} attention norms and biases", layers * (norm_parameters(config) + biases)),
    )
    return ModelTerms(weights, (AttentionTerm(layers, tokens, tokens if keys is None else keys, width),))


def mlp_terms(name: str, config: TransformerConfig, layers: int, tokens: int) -> ModelTerms:
    """`layers` MLPs with the norm before each (`transformer.MLP`) over `tokens` tokens."""
    weights, biases = mlp_parameters(config, config.ffn_hidden_size)
    return ModelTerms(
        (
            WeightTerm(f"{name} MLP weights", layers * weights, tokens),
            WeightTerm(f"{name} MLP norms and biases", layers * (norm_parameters(config) + biases)),
        )
    )


def final_norm_terms(name: str, config: TransformerConfig) -> ModelTerms:
    return ModelTerms((WeightTerm(f"{name} final norm", norm_parameters(config)),))


def mlp_parameters(config: TransformerConfig, ffn_hidden_size: int) -> tuple[int, int]:
    """(weights, biases) of one MLP of `ffn_hidden_size` (`models.mlp.MLP`; SwiGLU's fc1 is twice as wide)."""
    fc1 = ffn_hidden_size * (2 if config.swiglu else 1)
    hidden = config.hidden_size
    return hidden * fc1 + ffn_hidden_size * hidden, (fc1 + hidden if config.add_bias_linear else 0)


def moe_terms(name: str, config: TransformerConfig, layers: int, tokens: int) -> ModelTerms:
    """`layers` MoE layers (`models.moe.layer.MoELayer`) over `tokens` tokens: the router over every token, each
    of the --num-experts experts over top k / experts of them (the active parameters, as Megatron's FLOPs count
    them), the shared experts and their gate over every token; the norm before each."""
    experts, hidden = config.num_experts, config.hidden_size
    expert_weights, expert_biases = mlp_parameters(config, config.moe_ffn_hidden_size)
    router = experts * hidden
    stored_only = (
        norm_parameters(config) + experts * expert_biases + (experts if config.add_bias_linear else 0)
    )
    every_token = router
    if config.moe_shared_expert_intermediate_size is not None:
        shared_weights, shared_biases = mlp_parameters(config, config.moe_shared_expert_intermediate_size)
        every_token += shared_weights + (hidden if config.moe_shared_expert_gate else 0)
        stored_only += shared_biases
    return ModelTerms(
        (
            WeightTerm(f"{name} MoE routers and shared experts", layers * every_token, tokens),
            WeightTerm(
                f"{name} MoE experts",
                layers * experts * expert_weights,
                tokens * config.moe_router_topk / experts,
            ),
            WeightTerm(f"{name} MoE norms and biases", layers * stored_only),
        )
    )


def cross_attention_terms(
    name: str, config: TransformerConfig, layers: int, tokens: int, context_tokens: int, keys: int
) -> ModelTerms:
    """`layers` cross-attentions (`cross_attention.CrossAttention` and the norm before it): queries and output
    projected over `tokens` tokens, keys and values over `context_tokens` context tokens, each query attending to
    `keys` of them."""
    hidden, width, kv_width = config.hidden_size, attention_width(config), _kv_width(config)
    biases = width + 2 * kv_width + hidden if config.add_bias_linear else 0
    weights = (
        WeightTerm(f"{name} cross-attention query and output weights", layers * 2 * hidden * width, tokens),
        WeightTerm(
            f"{name} cross-attention key and value weights", layers * hidden * 2 * kv_width, context_tokens
        ),
        WeightTerm(f"{name} cross-attention norms and biases", layers * (norm_parameters(config) + biases)),
    )
    return ModelTerms(weights, (AttentionTerm(layers, tokens, keys, width),))


def _kv_width(config: TransformerConfig) -> int:
    return config.num_query_groups_effective * config.kv_channels


def embedding_terms(config: TransformerConfig, padded_vocab_size: int, num_tokentypes: int = 0) -> ModelTerms:
    """`models.language_module.LanguageModelEmbedding`: word, learned position and token type tables (looked up,
    never multiplied), and the post-LN embedding norm."""
    hidden = config.hidden_size
    count = padded_vocab_size * hidden + num_tokentypes * hidden
    if config.position_embedding_type == "learned_absolute":
        count += config.max_position_embeddings * hidden
    if config.post_ln:
        count += norm_parameters(config)
    return ModelTerms((WeightTerm("embeddings", count),))


def output_layer_terms(
    config: TransformerConfig, padded_vocab_size: int, tokens: int, bias: bool = False
) -> ModelTerms:
    """`models.language_module.build_output_layer` over `tokens` tokens: its own weight, or the word embedding's
    again when tied; a bias (BERT's, T5's) of the padded vocabulary."""
    tied = not config.untie_embeddings_and_output_weights
    weights = [WeightTerm("output layer", padded_vocab_size * config.hidden_size, tokens, stored=not tied)]
    if bias:
        weights.append(WeightTerm("output layer bias", padded_vocab_size))
    return ModelTerms(tuple(weights))
