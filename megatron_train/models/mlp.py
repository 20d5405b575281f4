"""The feed-forward block of a dense transformer layer, and the nonlinearity it shares with MoE experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.init import init_method_normal, scaled_init_method_normal
from megatron_train.parallel.layers import ColumnParallelLinear, RowParallelLinear


def activation(config: TransformerConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """fc1's output -> fc2's input: SwiGLU over the [gate; up] halves of the last dimension, else GELU (the tanh form
    with --openai-gelu or Megatron's bias-GELU fusion: `config.gelu_approximate`) or ReLU (T5 v1.0)."""
    if config.swiglu:

        def swiglu(x: torch.Tensor) -> torch.Tensor:
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up

        return swiglu
    if config.activation_func == "relu":
        return F.relu
    approximate = config.gelu_approximate
    return lambda x: F.gelu(x, approximate=approximate)


def residual_projection(
    input_size: int, config: TransformerConfig, sequence_parallel: bool, tp_group: dist.ProcessGroup | None
) -> RowParallelLinear:
    """A projection back into the residual stream (the MLP's fc2, the attention's output): row-parallel over
    `tp_group`, its init scaled by the depth as Megatron's output layers are."""
    return RowParallelLinear(
        input_size,
        config.hidden_size,
        init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
        bias=config.add_bias_linear,
        sequence_parallel=sequence_parallel,
        params_dtype=config.params_dtype,
        tp_group=tp_group,
    )


class MLP(nn.Module):
    """h -> ffn (GELU, or ReLU as T5 v1.0) -> h, or SwiGLU: fc1 computes [gate; up] (TP stride 2: each rank has
    its slice of both). The ffn dimension is split over `tp_group`; `ffn_hidden_size` replaces --ffn-hidden-size
    (an MoE layer's shared experts)."""

    def __init__(
        self,
        config: TransformerConfig,
        sequence_parallel: bool,
        tp_group: dist.ProcessGroup | None = None,
        ffn_hidden_size: int | None = None,
    ) -> None:
        super().__init__()
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        self.activation = activation(config)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            2 * ffn_hidden_size if config.swiglu else ffn_hidden_size,
            init_method=init_method_normal(config.init_method_std),
            bias=config.add_bias_linear,
            stride=2 if config.swiglu else 1,
            sequence_parallel=sequence_parallel,
            params_dtype=config.params_dtype,
            tp_group=tp_group,
        )
        self.linear_fc2 = residual_projection(ffn_hidden_size, config, sequence_parallel, tp_group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(hidden)))
