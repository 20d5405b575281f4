"""The transformer layer stack: self-attention, MLP, pre-norm residual layers, and activation recompute.

Activations are [s, b, h] (sequence first, as Megatron), so sequence parallelism splits the first dimension.
Parameter names follow Megatron-Core (`self_attention.linear_qkv`, `mlp.linear_fc1`, `input_layernorm`, ...).

Fused QKV layout (checkpoint conversion depends on it): linear_qkv's output rows are grouped by query
group g = 0 .. num_query_groups - 1, and each group holds [its heads_per_group query heads, its key head,
its value head], each kv_channels rows. Splitting the rows evenly across TP ranks therefore gives each rank
whole query groups. `pack_qkv` / `unpack_qkv` convert from / to separate q, k, v projections.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.context_attention import ContextParallelDocuments, context_parallel_attention
from megatron_train.models.init import init_method_normal
from megatron_train.models.kv_cache import KVCache
from megatron_train.models.mlp import MLP, residual_projection
from megatron_train.models.moe.layer import MoELayer
from megatron_train.models.norms import build_norm
from megatron_train.models.rotary import apply_rotary_pos_emb
from megatron_train.parallel import state
from megatron_train.parallel.config import pipeline_stage_layer_counts
from megatron_train.parallel.layers import ColumnParallelLinear, RowParallelLinear, divide
from megatron_train.parallel.random import checkpoint, get_rng_tracker, initialization_stream

Rotary = tuple[torch.Tensor, torch.Tensor] | None
# --use-cpu-initialization streams (parallel.random.initialization_stream): embeddings and output layer first,
# then one per layer by global layer number; BERT's extra parts count down from the last stream of a seed.
WORD_EMBEDDING_INIT_STREAM, POSITION_EMBEDDING_INIT_STREAM, OUTPUT_LAYER_INIT_STREAM = 0, 1, 2
FIRST_LAYER_INIT_STREAM = 3
TOKENTYPE_EMBEDDING_INIT_STREAM, LM_HEAD_INIT_STREAM, POOLER_INIT_STREAM, BINARY_HEAD_INIT_STREAM = (
    (1 << 20) - 1 - offset for offset in range(4)
)
ENCODER_RELATIVE_BIAS_INIT_STREAM, DECODER_RELATIVE_BIAS_INIT_STREAM = (
    (1 << 20) - 5 - offset for offset in range(2)
)


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """Fuse separate projections q [heads * d, ...], k and v [groups * d, ...] (weights or biases) into the
    grouped linear_qkv layout [groups * (heads_per_group + 2) * d, ...]."""
    q_groups = q.reshape(num_query_groups, -1, *q.shape[1:])
    k_groups = k.reshape(num_query_groups, -1, *k.shape[1:])
    v_groups = v.reshape(num_query_groups, -1, *v.shape[1:])
    return torch.cat((q_groups, k_groups, v_groups), dim=1).reshape(-1, *q.shape[1:])


def unpack_qkv(
    qkv: torch.Tensor, num_query_groups: int, num_attention_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `pack_qkv`: q [heads * d, ...], k [groups * d, ...], v [groups * d, ...]."""
    heads_per_group = num_attention_heads // num_query_groups
    head_dim = qkv.shape[0] // (num_query_groups * (heads_per_group + 2))
    grouped = qkv.reshape(num_query_groups, heads_per_group + 2, head_dim, *qkv.shape[1:])
    q, k, v = grouped.split([heads_per_group, 1, 1], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))


def get_layer_range(
    num_layers: int,
    pipeline_rank: int = 0,
    pipeline_size: int = 1,
    virtual_rank: int = 0,
    virtual_size: int | None = None,
    first: int | None = None,
    last: int | None = None,
) -> range:
    """Global indices of the layers one pipeline stage (model chunk, when interleaved) holds.

    Stage p holds `pipeline_stage_layer_counts` [p] layers after those of the stages before it. Interleaved,
    each stage's layers split into `virtual_size` equal chunks in Megatron's order: chunk v of stage p starts at
    v * num_layers / virtual_size plus the chunk-sized shares of the stages before p.
    """
    counts = pipeline_stage_layer_counts(num_layers, pipeline_size, first, last)
    chunks = virtual_size or 1
    if any(count % chunks for count in counts):
        raise ValueError(
            f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pipeline_size}"
            + (f" x {virtual_size} virtual stages" if virtual_size else "")
        )
    per_chunk = counts[pipeline_rank] // chunks
    start = virtual_rank * (num_layers // chunks) + sum(count // chunks for count in counts[:pipeline_rank])
    return range(start, start + per_chunk)


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """bool [b, 1, s, s]: query i may attend key j when j <= i and both lie in the same document (Megatron's
    --reset-attention-mask, and packed SFT conversations); `document_ids` [b, s] numbers each position's
    document."""
    seq = document_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    return (same_document & causal).unsqueeze(1)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + mask) v, by flash-attn or torch's scaled_dot_product_attention; over a sequence
    split across `cp_group` (context parallelism), by `models.context_attention` (--cp-comm-type), causal, its
    `attention_mask` then None or the whole sequence's documents (`ContextParallelDocuments`).

    Causal by default; with an `attention_mask` (bool, True where a key may be attended: [b, 1, 1, s_k], BERT's
    padding mask, bidirectional over the unmasked keys; or [b, 1, s_q, s_k], e.g. `document_causal_mask`)
    attention follows the mask alone, by scaled_dot_product_attention (flash-attn takes no dense mask).
    `causal=False` (cross-attention) attends to every key when no mask is given.

    Takes q [b, s_q, heads, d] and k, v [b, s_k, groups, d] (the kernels' layout) with s_k >= s_q: the queries
    are the last s_q positions (a KV cache holds the first s_k - s_q), so the causal mask is aligned
    bottom-right. Returns the context in the model's layout [s_q, b, heads * d].
    """

    def __init__(
        self,
        config: TransformerConfig,
        sequence_parallel: bool,
        causal: bool = True,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.causal = causal
        self.dropout_p = config.attention_dropout
        # Under sequence parallelism the whole block already runs on the tracked RNG stream.
        self.fork_rng = not sequence_parallel
        self.flash_attn_func = _load_flash_attn() if config.use_flash_attn else None
        self.cp_group = cp_group if state.group_size(cp_group) > 1 else None
        self.cp_comm_type = config.cp_comm_type
        if self.cp_group is not None and (self.dropout_p > 0 or not causal):
            raise ValueError(
                "context parallelism splits causal self-attention without dropout: pass --attention-dropout 0"
                if causal
                else "context parallelism splits causal self-attention only, not this attention"
            )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | ContextParallelDocuments | None = None,
    ) -> torch.Tensor:
        if self.cp_group is not None:
            context = context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type, attention_mask)
            return context.reshape(*context.shape[:2], -1)
        dropout_p = self.dropout_p if self.training else 0.0
        rng = get_rng_tracker().fork() if dropout_p > 0 and self.fork_rng else contextlib.nullcontext()
        with rng:
            if attention_mask is not None:  # also under --use-flash-attn: its kernel takes no dense mask
                context = self._sdpa(q, k, v, dropout_p, attention_mask)
            elif self.flash_attn_func is not None:
                if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
                    raise RuntimeError(
                        f"--use-flash-attn needs CUDA fp16/bf16 activations, got {q.dtype} on {q.device}; "
                        "pass --bf16/--fp16 on a GPU or drop --use-flash-attn"
                    )
                context = self.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=self.causal)
                context = context.transpose(0, 1)
            else:
                context = self._sdpa(q, k, v, dropout_p, causal=self.causal)
        return context.reshape(*context.shape[:2], -1)

    @staticmethod
    def _sdpa(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float,
        attention_mask: torch.Tensor | None = None,
        causal: bool = True,
    ) -> torch.Tensor:
        heads_per_group = q.shape[2] // k.shape[2]
        if heads_per_group > 1:  # query head j attends with key/value head j // heads_per_group
            k = k.repeat_interleave(heads_per_group, dim=2)
            v = v.repeat_interleave(heads_per_group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        s_q, s_k = q.shape[2], k.shape[2]
        causal = causal and attention_mask is None
        mask, is_causal = attention_mask, causal and s_q == s_k
        if causal and 1 < s_q < s_k:  # new tokens after cached ones: query i sees keys up to s_k - s_q + i
            positions = torch.arange(s_k, device=q.device)
            mask = positions[None, :] <= positions[s_k - s_q :, None]
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
        )
        return context.permute(2, 0, 1, 3)  # [s_q, b, heads, d]


def _load_flash_attn() -> Callable[..., torch.Tensor]:
    """flash_attn_func, or a clear error where it cannot run (never a silent fallback)."""
    try:
        from flash_attn import flash_attn_func
    except ImportError as error:
        raise RuntimeError(
            "--use-flash-attn was set but the flash-attn package is not installed: "
            "`pip install flash-attn` on a CUDA machine, or drop --use-flash-attn"
        ) from error
    if not torch.cuda.is_available():
        raise RuntimeError(
            "--use-flash-attn needs a CUDA GPU; drop it to use torch's scaled_dot_product_attention"
        )
    return flash_attn_func


def attention_output_projection(
    config: TransformerConfig, sequence_parallel: bool, tp_group: dist.ProcessGroup | None
) -> RowParallelLinear:
    """The attention's output projection (all heads -> hidden, row-parallel over the heads of `tp_group`), its
    init scaled by the depth as Megatron's output layers are; self- and cross-attention share it."""
    return residual_projection(
        config.num_attention_heads * config.kv_channels, config, sequence_parallel, tp_group
    )


class SelfAttention(nn.Module):
    """Self-attention with this TP rank's query groups (causal, or over `attention_mask`); optional RoPE and KV
    cache. The heads are split over `tp_group`, the sequence over `cp_group` (context parallelism)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_index: int,
        sequence_parallel: bool,
        tp_group: dist.ProcessGroup | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        world_size = state.group_size(state.tensor_group_or_default(tp_group))
        groups = config.num_query_groups_effective
        self.layer_index = layer_index  # position within this stage, the KV cache's layer slot
        self.head_dim = config.kv_channels
        self.num_heads = divide(config.num_attention_heads, world_size, "--num-attention-heads")
        self.num_groups = divide(groups, world_size, "number of query groups")
        self.heads_per_group = config.num_attention_heads // groups
        self.recompute_core_attention = config.recompute_granularity == "selective"
        init = init_method_normal(config.init_method_std)
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            (config.num_attention_heads + 2 * groups) * self.head_dim,
            init_method=init,
            bias=config.add_bias_linear or config.add_qkv_bias,
            sequence_parallel=sequence_parallel,
            params_dtype=config.params_dtype,
            tp_group=tp_group,
        )
        self.core_attention = CoreAttention(config, sequence_parallel, cp_group=cp_group)
        self.linear_proj = attention_output_projection(config, sequence_parallel, tp_group)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Rotary,
        kv_cache: KVCache | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        qkv = self.linear_qkv(hidden)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.num_groups, self.heads_per_group + 2, self.head_dim)
        q, k, v = qkv.split([self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.num_heads, self.head_dim)
        k, v = k.squeeze(3), v.squeeze(3)
        if rotary is not None:
            q, k = apply_rotary_pos_emb(q, *rotary), apply_rotary_pos_emb(k, *rotary)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]: the layout both kernels take
        if kv_cache is not None:
            if self.core_attention.cp_group is not None:
                raise ValueError("a KV cache (generation) runs without context parallelism")
            k, v = kv_cache.update(self.layer_index, k, v)
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            context = checkpoint(self.core_attention, q, k, v, attention_mask)
        else:
            context = self.core_attention(q, k, v, attention_mask)
        return self.linear_proj(context)


class TransformerLayer(nn.Module):
    """Pre-norm residual layer (Megatron's): x + dropout(attn(norm(x))), then x + dropout(mlp(norm(x))).

    With `config.post_ln` the original Transformer/BERT layer: norm(x + dropout(attn(x))), then
    norm(x + dropout(mlp(x))), its norms named `post_attention_layernorm` and `post_mlp_layernorm`.
    A `cross_attention` module (T5's decoder, Retro's chunked cross-attention) adds a third residual between
    the two, over the `context` passed to forward: x + dropout(cross(norm(x), context)) (post-LN: norm after).
    Forward returns (hidden, context) as Megatron-Core's layer: a cross-attention module may return
    (output, new context), which the following layers then get (Retro's first chunked cross-attention layer
    hands on its encoder's output); otherwise the context passes through unchanged.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_index: int,
        sequence_parallel: bool,
        cross_attention: nn.Module | None = None,
        pg_collection: state.ProcessGroupCollection | None = None,
        layer_number: int | None = None,
    ) -> None:
        """`layer_index`: the layer's place in this stage (its KV-cache slot); `layer_number`: its global index
        (default `layer_index`), which decides whether its MLP is an MoE layer (--moe-layer-freq);
        `pg_collection`: the groups it is split over (default parallel.state's)."""
        super().__init__()
        pg_collection = pg_collection or state.process_groups()
        tp_group = pg_collection.tp
        self.post_ln = config.post_ln
        if not self.post_ln:
            self.input_layernorm = build_norm(config, sequence_parallel)
        self.self_attention = SelfAttention(
            config, layer_index, sequence_parallel, tp_group, pg_collection.cp
        )
        if self.post_ln:
            self.post_attention_layernorm = build_norm(config, sequence_parallel)
        self.cross_attention = cross_attention
        if cross_attention is not None:
            norm_name = "post_cross_attn_layernorm" if self.post_ln else "pre_cross_attn_layernorm"
            setattr(self, norm_name, build_norm(config, sequence_parallel))
        if not self.post_ln:
            self.pre_mlp_layernorm = build_norm(config, sequence_parallel)
        layer_number = layer_index if layer_number is None else layer_number
        if config.is_moe_layer(layer_number):
            self.mlp = MoELayer(config, layer_number, sequence_parallel, pg_collection)
        else:
            self.mlp = MLP(config, sequence_parallel, tp_group)
        if self.post_ln:
            self.post_mlp_layernorm = build_norm(config, sequence_parallel)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Rotary = None,
        kv_cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.post_ln:
            attention = self.self_attention(hidden, rotary, kv_cache, attention_mask)
            hidden = self.post_attention_layernorm(hidden + self.hidden_dropout(attention))
            if self.cross_attention is not None:
                cross, context = self._cross_attend(hidden, context, context_mask)
                hidden = self.post_cross_attn_layernorm(hidden + self.hidden_dropout(cross))
            return self.post_mlp_layernorm(hidden + self.hidden_dropout(self.mlp(hidden))), context
        attention = self.self_attention(self.input_layernorm(hidden), rotary, kv_cache, attention_mask)
        hidden = hidden + self.hidden_dropout(attention)
        if self.cross_attention is not None:
            cross, context = self._cross_attend(self.pre_cross_attn_layernorm(hidden), context, context_mask)
            hidden = hidden + self.hidden_dropout(cross)
        return hidden + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(hidden))), context

    def _cross_attend(
        self, hidden: torch.Tensor, context: torch.Tensor | None, context_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        output = self.cross_attention(hidden, context, context_mask)
        return output if isinstance(output, tuple) else (output, context)


class TransformerBlock(nn.Module):
    """This pipeline stage's layers (those of model chunk `vp_stage` when interleaved), the final norm on the
    last stage (none with post-LN layers, which end in a norm), and full-layer recompute.

    `cross_attention_for(global_layer_number)` gives a layer its cross-attention module (or None): every layer
    of T5's decoder, Retro's chunked cross-attention layers. `first_init_stream`: the --use-cpu-initialization
    stream of layer 0 (T5's decoder starts after the encoder's layers). `pg_collection`: the groups the layers
    are split over (the stage's layers from its pipeline group; default parallel.state's)."""

    def __init__(
        self,
        config: TransformerConfig,
        sequence_parallel: bool,
        post_process: bool,
        init_seed: int | None = None,
        vp_stage: int = 0,
        cross_attention_for: Callable[[int], nn.Module | None] | None = None,
        first_init_stream: int = FIRST_LAYER_INIT_STREAM,
        pg_collection: state.ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.sequence_parallel = sequence_parallel
        pg_collection = pg_collection or state.process_groups()
        self.layer_range = get_layer_range(
            config.num_layers,
            state.group_rank(pg_collection.pp),
            state.group_size(pg_collection.pp),
            vp_stage,
            state.get_virtual_pipeline_model_parallel_world_size(),
            config.num_layers_in_first_pipeline_stage,
            config.num_layers_in_last_pipeline_stage,
        )
        layers = []
        for index, global_index in enumerate(self.layer_range):
            with initialization_stream(init_seed, first_init_stream + global_index):
                cross_attention = cross_attention_for(global_index) if cross_attention_for else None
                layers.append(
                    TransformerLayer(
                        config,
                        index,
                        sequence_parallel,
                        cross_attention,
                        pg_collection,
                        layer_number=global_index,
                    )
                )
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = (
            build_norm(config, sequence_parallel) if post_process and not config.post_ln else None
        )
        self.input_tensor: torch.Tensor | None = None  # from the previous pipeline stage

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Rotary = None,
        kv_cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`attention_mask`: bool, True where a query may attend a key: [b, 1, 1, s] over the keys (BERT's
        bidirectional padding mask) or [b, 1, s, s] per query (`document_causal_mask`); None: causal.
        `context` [s_k, b, h] and `context_mask` [b, 1, 1, s_k] feed the layers' cross-attention; a layer may
        hand the layers after it another context (see `TransformerLayer`)."""
        # Sequence-parallel shards differ across TP ranks, so their dropout draws from the tracked stream.
        rng = get_rng_tracker().fork() if self.sequence_parallel else contextlib.nullcontext()
        with rng:
            recompute = (
                self.config.recompute_granularity == "full" and self.training and torch.is_grad_enabled()
            )
            if recompute and kv_cache is None:
                hidden = self._forward_with_recompute(hidden, rotary, attention_mask, context, context_mask)
            else:
                for layer in self.layers:
                    hidden, context = layer(hidden, rotary, kv_cache, attention_mask, context, context_mask)
        return hidden if self.final_layernorm is None else self.final_layernorm(hidden)

    def _forward_with_recompute(
        self,
        hidden: torch.Tensor,
        rotary: Rotary,
        attention_mask: torch.Tensor | None,
        context: torch.Tensor | None,
        context_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """'uniform': checkpoint chunks of recompute_num_layers layers; 'block': checkpoint each of the first
        recompute_num_layers layers and run the rest normally."""
        cos, sin = rotary if rotary is not None else (None, None)
        step = self.config.recompute_num_layers if self.config.recompute_method == "uniform" else 1
        for start in range(0, len(self.layers), step):
            layers = self.layers[start : start + step]
            if self.config.recompute_method == "block" and start >= self.config.recompute_num_layers:
                hidden, context = self._run_layers(
                    layers, hidden, cos, sin, attention_mask, context, context_mask
                )
            else:
                hidden, context = checkpoint(
                    self._run_layers, layers, hidden, cos, sin, attention_mask, context, context_mask
                )
        return hidden

    @staticmethod
    def _run_layers(
        layers: nn.ModuleList,
        hidden: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rotary = None if cos is None else (cos, sin)
        for layer in layers:
            hidden, context = layer(hidden, rotary, None, attention_mask, context, context_mask)
        return hidden, context
