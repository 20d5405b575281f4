"""Cross-attention: queries from the hidden states, keys and values from a context (Megatron-Core's CrossAttention).

T5's decoder attends to the encoder output with it, and Retro's chunked cross-attention to its encoded
neighbours. Tensor parallel as self-attention (each rank holds whole query groups: `linear_q` and `linear_kv`
column parallel, `linear_proj` row parallel). Under sequence parallelism the hidden states and the context both
arrive split along the sequence and are all-gathered by their column-parallel projection.

`linear_kv`'s output rows are grouped by query group, each group [its key head; its value head], kv_channels
rows each (Megatron-Core's layout, which checkpoint conversion relies on).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.init import init_method_normal
from megatron_train.models.transformer import CoreAttention, attention_output_projection
from megatron_train.parallel import state
from megatron_train.parallel.layers import ColumnParallelLinear, divide


class CrossAttention(nn.Module):
    """softmax(q(hidden) k(context)^T) v(context), bidirectional over the context (or over `context_mask`); the
    heads split over `tp_group`."""

    def __init__(
        self, config: TransformerConfig, sequence_parallel: bool, tp_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        world_size = state.group_size(state.tensor_group_or_default(tp_group))
        groups = config.num_query_groups_effective
        self.head_dim = config.kv_channels
        self.num_heads = divide(config.num_attention_heads, world_size, "--num-attention-heads")
        self.num_groups = divide(groups, world_size, "number of query groups")
        init = init_method_normal(config.init_method_std)
        column = dict(
            bias=config.add_bias_linear,
            sequence_parallel=sequence_parallel,
            params_dtype=config.params_dtype,
            tp_group=tp_group,
        )
        self.linear_q = ColumnParallelLinear(
            config.hidden_size, config.num_attention_heads * self.head_dim, init_method=init, **column
        )
        self.linear_kv = ColumnParallelLinear(
            config.hidden_size, 2 * groups * self.head_dim, init_method=init, **column
        )
        self.core_attention = CoreAttention(config, sequence_parallel, causal=False)
        self.linear_proj = attention_output_projection(config, sequence_parallel, tp_group)

    def forward(
        self, hidden: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [s_q, b, h], context [s_k, b, h] (each / TP along s under SP); `context_mask` bool
        [b, 1, 1, s_k], True on the context positions to attend. Returns [s_q, b, h] (/ TP under SP)."""
        q = self.linear_q(hidden)
        kv = self.linear_kv(context)
        q = q.view(*q.shape[:2], self.num_heads, self.head_dim)
        k, v = kv.view(*kv.shape[:2], self.num_groups, 2, self.head_dim).unbind(dim=3)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]: the layout both kernels take
        return self.linear_proj(self.core_attention(q, k, v, context_mask))
