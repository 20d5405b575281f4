"""The MoE layer that replaces a transformer layer's MLP (Megatron-Core's MoELayer): route, dispatch, run the local
experts, combine, and add the shared experts' output."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.init import init_method_normal
from megatron_train.models.mlp import MLP
from megatron_train.models.moe.dispatcher import DISPATCHERS
from megatron_train.models.moe.experts import Experts
from megatron_train.models.moe.router import TopKRouter
from megatron_train.parallel import state
from megatron_train.parallel.param_init import new_parameter
from megatron_train.parallel.random import checkpoint


class SharedExpertMLP(MLP):
    """Experts every token goes through (Megatron's shared experts, --moe-shared-expert-intermediate-size): a
    tensor-parallel MLP of that hidden size; with --moe-shared-expert-gate its output is scaled per token by
    sigmoid(x . gate_weight) (Qwen2-MoE's shared_expert_gate)."""

    def __init__(
        self, config: TransformerConfig, sequence_parallel: bool, tp_group: dist.ProcessGroup | None
    ) -> None:
        super().__init__(config, sequence_parallel, tp_group, config.moe_shared_expert_intermediate_size)

        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.gate_weight = new_parameter(
                (1, config.hidden_size), config.params_dtype, init_method_normal(config.init_method_std)
            )
            self.gate_weight.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden)
        if self.gate_weight is None:
            return out
        return out * torch.sigmoid(nn.functional.linear(hidden, self.gate_weight))


class MoELayer(nn.Module):
    """hidden [s, b, h] (the sequence shard under SP) -> [s, b, h]: each token's top-k experts' outputs weighted
    by the router's probabilities, plus the shared experts'. `layer_number` is the layer's global index (the
    router records its losses there); `pg_collection` gives the groups (default parallel.state's). With
    --moe-layer-recompute its activations are recomputed in the backward pass."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        sequence_parallel: bool,
        pg_collection: state.ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__()
        pg_collection = pg_collection or state.process_groups()
        self.router = TopKRouter(config, layer_number, sequence_parallel, pg_collection)
        self.experts = Experts(config, pg_collection)
        self.shared_experts = (
            SharedExpertMLP(config, sequence_parallel, pg_collection.tp)
            if config.moe_shared_expert_intermediate_size is not None
            else None
        )
        self.token_dispatcher = DISPATCHERS[config.moe_token_dispatcher_type](
            config.num_experts, pg_collection
        )
        self.recompute = config.moe_layer_recompute

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, hidden)
        return self._forward(hidden)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        probs, routing_map = self.router(hidden)
        tokens, tokens_per_expert = self.token_dispatcher.dispatch(
            hidden.reshape(-1, hidden.shape[-1]), probs, routing_map
        )
        output = self.token_dispatcher.combine(self.experts(tokens, tokens_per_expert)).view_as(hidden)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden)
        return output
