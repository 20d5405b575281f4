"""The transformer's shape and behaviour: Megatron's model flags as one typed config.

GPT-2 and Llama are configurations of the same model: GPT-2 is learned_absolute + LayerNorm + GELU
(openai_gelu) + biases + tied embeddings; Llama is rope + RMSNorm + swiglu + disable_bias_linear +
untie_embeddings_and_output_weights (+ group_query_attention for Llama-2 70B and later).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from megatron_train.models.hybrid_pattern import MOE, hybrid_layer_count, moe_layer_flags, pattern_from_ratios
from megatron_train.models.moe.config import MoEConfig

PositionEmbeddingType = Literal["learned_absolute", "rope", "relative", "none"]
Normalization = Literal["LayerNorm", "RMSNorm"]
ActivationFunc = Literal["gelu", "relu"]
RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]
# --cp-comm-type: ring (p2p), all-gathered keys and values (Megatron spells it allgather), or all-to-all (a2a).
CPCommType = Literal["p2p", "all_gather", "allgather", "a2a"]


@dataclass
class TransformerConfig(MoEConfig):
    """The model's shape and behaviour; the MoE flags are `MoEConfig`'s (models/moe/config.py)."""

    model_family: str | None = field(
        default=None,
        kw_only=True,
        metadata={
            "help": "The model family to train or load: a family of this project (gpt, bert, t5, retro; default "
            "the entry point's) or `pkg.module:ATTR` naming a ModelFamily defined elsewhere, which checkpoints "
            "record and loaders then ask for (docs/architecture.md, model families)."
        },
    )
    num_layers: int | None = field(
        default=None,
        kw_only=True,
        metadata={"help": "Number of transformer layers (T5: the encoder's; default --encoder-num-layers)."},
    )
    num_layers_in_first_pipeline_stage: int | None = field(
        default=None,
        kw_only=True,
        metadata={
            "help": "Layers of the first pipeline stage (uneven split); the other stages share the rest."
        },
    )
    num_layers_in_last_pipeline_stage: int | None = field(
        default=None,
        kw_only=True,
        metadata={
            "help": "Layers of the last pipeline stage (uneven split); the other stages share the rest."
        },
    )
    hidden_size: int = field(metadata={"help": "Transformer hidden size."})
    num_attention_heads: int = field(metadata={"help": "Number of attention heads."})
    ffn_hidden_size: int | None = field(
        default=None,
        metadata={
            "help": "MLP hidden size; default 4 * hidden-size, or int(8 * hidden-size / 3 / 64) * 64 with --swiglu."
        },
    )
    kv_channels: int | None = field(
        default=None,
        metadata={"help": "Per-head projection size; default hidden-size / num-attention-heads."},
    )
    group_query_attention: bool = field(default=False, metadata={"help": "Use grouped-query attention."})
    num_query_groups: int = field(
        default=1, metadata={"help": "Number of key/value head groups with --group-query-attention."}
    )
    true_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "Vocabulary size before padding; default the tokenizer's. Logits of the padding rows are "
            "masked out of the loss and of generation."
        },
    )
    seq_length: int | None = field(default=None, metadata={"help": "Maximum sequence length to process."})
    max_position_embeddings: int | None = field(
        default=None, metadata={"help": "Size of the learned position table; default seq-length."}
    )
    position_embedding_type: PositionEmbeddingType = field(
        default="learned_absolute",
        metadata={
            "help": "Position embedding: learned_absolute, rope, relative (T5's bucketed attention bias), or none "
            "(GPT without any position signal but the causal mask's; Mamba and hybrid models: the Mamba layers "
            "see the order)."
        },
    )
    rotary_percent: float = field(
        default=1.0, metadata={"help": "Fraction of each head's dims rotated by RoPE."}
    )
    rotary_base: int = field(default=10000, metadata={"help": "Base period of the rotary embedding."})
    use_rope_scaling: bool = field(
        default=False,
        metadata={"help": "Llama-3.1's RoPE frequency scaling (low 1, high 4, original context 8192)."},
    )
    rope_scaling_factor: float = field(
        default=8.0, metadata={"help": "Factor of --use-rope-scaling (Llama-3.1: 8, Llama-3.2: 32)."}
    )
    normalization: Normalization = field(
        default="LayerNorm", metadata={"help": "Norm layer: LayerNorm or RMSNorm."}
    )
    norm_epsilon: float = field(default=1e-5, metadata={"help": "Epsilon of the norm layers."})
    post_ln: bool = field(
        default=False,
        metadata={
            "help": "Original BERT/Transformer layers: norm after each residual add (x = norm(x + f(x))), a norm "
            "on the embeddings and no final norm, as Hugging Face BERT checkpoints; default Megatron's pre-norm."
        },
    )
    bert_binary_head: bool = field(
        default=True,
        metadata={
            "help": "BERT: the binary (sentence order) head and its loss; --bert-no-binary-head drops it.",
            "flag": "--bert-no-binary-head",
            "opposite_flag": "--bert-binary-head",
        },
    )
    apply_layernorm_1p: bool = field(
        default=False,
        metadata={"help": "Store norm weights zero-centred (weight - 1); the forward scales by 1 + weight."},
    )
    swiglu: bool = field(default=False, metadata={"help": "Use the gated SwiGLU MLP instead of GELU."})
    activation_func: ActivationFunc = field(
        default="gelu",
        metadata={
            "help": "MLP activation without --swiglu: gelu, or relu (T5 v1.0's, for its Hugging Face weights)."
        },
    )
    openai_gelu: bool = field(
        default=False, metadata={"help": "Use OpenAI's tanh approximation of GELU (GPT-2's 'gelu_new')."}
    )
    bias_gelu_fusion: bool = field(
        default=True,
        metadata={
            "help": "Megatron's fused bias + GELU of the MLP, which computes GELU's tanh approximation; "
            "--no-bias-gelu-fusion adds the bias, then applies the exact (erf) GELU. Without linear biases "
            "(--disable-bias-linear) there is nothing to fuse: exact GELU."
        },
    )
    add_bias_linear: bool = field(
        default=True,
        metadata={
            "help": "Bias in linear layers; the flag --disable-bias-linear sets it False.",
            "flag": "--disable-bias-linear",
        },
    )
    add_qkv_bias: bool = field(
        default=False,
        metadata={
            "help": "Bias in the attention's QKV projection only, even with --disable-bias-linear (Qwen2's q/k/v "
            "biases)."
        },
    )
    untie_embeddings_and_output_weights: bool = field(
        default=False,
        metadata={"help": "Give the output layer its own weight instead of the word embedding."},
    )
    hidden_dropout: float = field(
        default=0.1, metadata={"help": "Dropout on embeddings and residual branches."}
    )
    attention_dropout: float = field(default=0.1, metadata={"help": "Dropout on attention probabilities."})
    init_method_std: float = field(
        default=0.02,
        metadata={
            "help": "Std of the normal weight init; output projections use std / sqrt(2 * num-layers)."
        },
    )
    embedding_weights_in_fp32: bool = field(
        default=False,
        metadata={
            "help": "Look the word embeddings up in fp32 (under --bf16/--fp16): the embedding's gradient is summed "
            "in fp32 over the repeats of each token, then rounded once (Megatron's, for reproducible bf16 runs)."
        },
    )
    use_flash_attn: bool = field(
        default=False,
        metadata={"help": "Use flash-attn's kernel (CUDA, fp16/bf16; errors where unavailable)."},
    )
    cp_comm_type: CPCommType = field(
        default="p2p",
        metadata={
            "help": "How attention reaches the keys and values of the other --context-parallel-size ranks: p2p "
            "(ring: blocks passed around with overlapped isend/irecv), all_gather (allgather) or a2a (heads "
            "exchanged for the whole sequence)."
        },
    )
    recompute_granularity: RecomputeGranularity | None = field(
        default=None,
        metadata={
            "help": "Activation recompute: 'full' (whole layers) or 'selective' (core attention only)."
        },
    )
    recompute_method: RecomputeMethod | None = field(
        default=None,
        metadata={
            "help": "With full recompute: 'uniform' (chunks of recompute-num-layers) or 'block' "
            "(the first recompute-num-layers layers of each stage)."
        },
    )
    recompute_num_layers: int | None = field(
        default=None, metadata={"help": "Layers per recompute chunk (uniform) or recomputed layers (block)."}
    )
    recompute_activations: bool = field(
        default=False, metadata={"help": "Shorthand for --recompute-granularity selective."}
    )
    fp16: bool = field(
        default=False, metadata={"help": "fp16 model, fp32 main params, dynamic loss scaling."}
    )
    bf16: bool = field(default=False, metadata={"help": "bf16 model with fp32 main params and grads."})

    encoder_num_layers: int | None = field(
        default=None, metadata={"help": "T5: encoder layers (the same as --num-layers; give one of the two)."}
    )
    decoder_num_layers: int | None = field(
        default=None, metadata={"help": "T5: decoder layers; default the encoder's."}
    )
    encoder_seq_length: int | None = field(
        default=None, metadata={"help": "T5: encoder sequence length (the same as --seq-length; give one)."}
    )
    decoder_seq_length: int | None = field(default=None, metadata={"help": "T5: decoder sequence length."})
    relative_attention_num_buckets: int = field(
        default=32, metadata={"help": "Buckets of --position-embedding-type relative (T5: 32)."}
    )
    relative_attention_max_distance: int = field(
        default=128,
        metadata={"help": "Distance from which relative positions share the last bucket (T5: 128)."},
    )

    hybrid_layer_pattern: str | None = field(
        default=None,
        metadata={
            "help": "A hybrid (Mamba) model's layers, one symbol each: M Mamba, * attention, - MLP, E MoE (needs "
            "--num-experts; the pattern, not --moe-layer-freq, places them); | cuts pipeline stages (Megatron's "
            "pretrain_hybrid). The layer count comes from it."
        },
    )
    hybrid_override_pattern: str | None = field(
        default=None, metadata={"help": "Deprecated name of --hybrid-layer-pattern (Megatron's older flag)."}
    )
    hybrid_attention_ratio: float = field(
        default=0.0,
        metadata={
            "help": "Deprecated: without a pattern, the share of --num-layers that are attention layers (evenly "
            "spaced among Mamba layers, as Megatron's pattern_from_ratios)."
        },
    )
    hybrid_mlp_ratio: float = field(
        default=0.0,
        metadata={"help": "Deprecated: without a pattern, the share of --num-layers that are MLP layers."},
    )
    mamba_state_dim: int = field(default=128, metadata={"help": "Mamba-2 SSM state size per head (d_state)."})
    mamba_head_dim: int = field(default=64, metadata={"help": "Mamba-2 head dimension."})
    mamba_num_groups: int = field(
        default=8, metadata={"help": "Mamba-2 groups of heads sharing B and C (split across TP)."}
    )
    mamba_num_heads: int | None = field(
        default=None,
        metadata={"help": "Mamba-2 heads; default 2 * hidden-size / mamba-head-dim (expand 2, as Megatron)."},
    )

    def __post_init__(self) -> None:
        # Megatron: --hybrid-override-pattern is the older name of --hybrid-layer-pattern; the pattern sets the
        # layer count (a different --num-layers is refused), the deprecated ratios make a pattern of it.
        self.hybrid_layer_pattern = _hybrid_pattern(self)
        if self.hybrid_layer_pattern is not None:
            self.num_layers = hybrid_layer_count(self.hybrid_layer_pattern, self.num_layers)
        # Megatron: --encoder-num-layers / --encoder-seq-length are other names of --num-layers / --seq-length.
        self.num_layers = _one_of(
            self.num_layers, self.encoder_num_layers, "--num-layers", "--encoder-num-layers"
        )
        self.seq_length = _one_of(
            self.seq_length, self.encoder_seq_length, "--seq-length", "--encoder-seq-length"
        )
        if self.num_layers is None:
            raise ValueError("set --num-layers (T5: or --encoder-num-layers)")
        if self.recompute_activations:
            self.recompute_granularity = "selective"
        if self.cp_comm_type == "allgather":  # Megatron's spelling
            self.cp_comm_type = "all_gather"
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                    f"{self.num_attention_heads}; set --kv-channels explicitly"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.swiglu:  # two input projections: keep the parameter count near 4h, a multiple of 64
                self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        self.normalize_moe()
        self._validate()

    def _validate(self) -> None:
        checks = [
            (
                MOE not in (self.hybrid_layer_pattern or "") or self.is_moe,
                f"--hybrid-layer-pattern {self.hybrid_layer_pattern!r} has MoE layers (E): they need --num-experts "
                "(and the --moe-* flags that shape them)",
            ),
            (
                self.position_embedding_type in get_args(PositionEmbeddingType),
                f"--position-embedding-type must be one of {get_args(PositionEmbeddingType)}, "
                f"got {self.position_embedding_type!r}",
            ),
            (
                self.normalization in get_args(Normalization),
                f"--normalization must be one of {get_args(Normalization)}, got {self.normalization!r}",
            ),
            (
                self.recompute_granularity in (None, *get_args(RecomputeGranularity)),
                f"--recompute-granularity must be 'full' or 'selective', got {self.recompute_granularity!r}",
            ),
            (
                self.cp_comm_type in get_args(CPCommType),
                f"--cp-comm-type must be p2p, all_gather (allgather) or a2a, got {self.cp_comm_type!r}"
                + (
                    "; a2a+p2p (hierarchical context parallelism) is not implemented"
                    if "+" in self.cp_comm_type
                    else ""
                ),
            ),
            (
                self.recompute_method in (None, *get_args(RecomputeMethod)),
                f"--recompute-method must be 'uniform' or 'block', got {self.recompute_method!r}",
            ),
            (
                self.recompute_granularity != "full"
                or (self.recompute_method is not None and (self.recompute_num_layers or 0) >= 1),
                "--recompute-granularity full needs --recompute-method (uniform|block) and --recompute-num-layers >= 1",
            ),
            (
                self.num_attention_heads % self.num_query_groups_effective == 0,
                f"--num-attention-heads {self.num_attention_heads} must be a multiple of --num-query-groups "
                f"{self.num_query_groups}",
            ),
            (
                0.0 < self.rotary_percent <= 1.0,
                f"--rotary-percent must be in (0, 1], got {self.rotary_percent}",
            ),
            (
                self.position_embedding_type != "learned_absolute"
                or self.max_position_embeddings is not None,
                "learned_absolute position embeddings need --max-position-embeddings or --seq-length",
            ),
            (
                self.position_embedding_type != "learned_absolute"
                or self.max_position_embeddings is None
                or (self.seq_length or 0) <= self.max_position_embeddings,
                f"{'--encoder-seq-length' if self.encoder_seq_length is not None else '--seq-length'} "
                f"{self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}: "
                "learned position embeddings have no row for the later positions; raise --max-position-embeddings",
            ),
            (
                self.position_embedding_type != "learned_absolute"
                or self.max_position_embeddings is None
                or (self.decoder_seq_length or 0) <= self.max_position_embeddings,
                f"--decoder-seq-length {self.decoder_seq_length} exceeds --max-position-embeddings "
                f"{self.max_position_embeddings}; raise --max-position-embeddings",
            ),
            (
                not (self.swiglu and self.activation_func != "gelu"),
                "--swiglu replaces the MLP activation: drop --activation-func",
            ),
            (not (self.fp16 and self.bf16), "--fp16 and --bf16 are mutually exclusive"),
            (
                self.ffn_hidden_size > 0,
                f"--ffn-hidden-size is {self.ffn_hidden_size} (the --swiglu rule rounds 8h/3 down to a multiple "
                "of 64); set --ffn-hidden-size explicitly",
            ),
        ]
        for ok, message in checks + self.moe_checks():
            if not ok:
                raise ValueError(message)
        if self.is_moe:
            self.moe_layer_pattern  # noqa: B018 - parsing --moe-layer-freq raises on a bad pattern

    @property
    def moe_layer_pattern(self) -> list[int]:
        """One 0/1 per layer, 1 for an MoE layer: a hybrid model's E layers, else --moe-layer-freq's."""
        if self.hybrid_layer_pattern is None:
            return super().moe_layer_pattern
        return moe_layer_flags(self.hybrid_layer_pattern)

    @property
    def num_decoder_layers(self) -> int:
        """T5's decoder layers: --decoder-num-layers, else as many as the encoder."""
        return self.decoder_num_layers if self.decoder_num_layers is not None else self.num_layers

    @property
    def gelu_approximate(self) -> Literal["tanh", "none"]:
        """The MLP's GELU as `F.gelu(approximate=...)`: tanh with --openai-gelu or Megatron's bias-GELU fusion."""
        return "tanh" if self.openai_gelu or (self.bias_gelu_fusion and self.add_bias_linear) else "none"

    @property
    def num_query_groups_effective(self) -> int:
        """Key/value heads: num_query_groups with GQA, else one per attention head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def params_dtype(self) -> torch.dtype:
        if self.bf16:
            return torch.bfloat16
        return torch.float16 if self.fp16 else torch.float32

    @classmethod
    def gpt2(
        cls,
        num_layers: int = 12,
        hidden_size: int = 768,
        num_attention_heads: int = 12,
        seq_length: int = 1024,
        **overrides,
    ) -> TransformerConfig:
        """GPT-2's architecture (defaults: the 124M model)."""
        return cls(
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            seq_length=seq_length,
            openai_gelu=True,
            **overrides,
        )

    @classmethod
    def llama(
        cls,
        num_layers: int = 32,
        hidden_size: int = 4096,
        num_attention_heads: int = 32,
        seq_length: int = 4096,
        **overrides,
    ) -> TransformerConfig:
        """Llama's architecture (defaults: Llama-2 7B's shape; its ffn_hidden_size is 11008)."""
        settings = dict(
            position_embedding_type="rope",
            normalization="RMSNorm",
            swiglu=True,
            add_bias_linear=False,
            untie_embeddings_and_output_weights=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            norm_epsilon=1e-5,
        )
        settings.update(overrides)
        return cls(
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            seq_length=seq_length,
            **settings,
        )


def _hybrid_pattern(config: TransformerConfig) -> str | None:
    """The layer pattern the hybrid flags give: --hybrid-layer-pattern, its older name, or one made from
    --num-layers and the deprecated ratios (None: not a hybrid model)."""
    pattern = config.hybrid_layer_pattern
    if config.hybrid_override_pattern is not None:
        if pattern is not None and pattern != config.hybrid_override_pattern:
            raise ValueError(
                "--hybrid-override-pattern is the deprecated name of --hybrid-layer-pattern: give one of them"
            )
        pattern, config.hybrid_override_pattern = config.hybrid_override_pattern, None
    ratios = config.hybrid_attention_ratio, config.hybrid_mlp_ratio
    if pattern is None and any(ratios):
        if config.num_layers is None:
            raise ValueError("--hybrid-attention-ratio / --hybrid-mlp-ratio need --num-layers")
        pattern = pattern_from_ratios(config.num_layers, *ratios)
    return pattern


def _one_of(value: int | None, alias: int | None, flag: str, alias_flag: str) -> int | None:
    """A setting given under either of its two Megatron names; both are allowed only when they agree."""
    if value is not None and alias is not None and value != alias:
        raise ValueError(f"{flag} {value} and {alias_flag} {alias} name the same setting: give one of them")
    return value if value is not None else alias
