"""The MoE layer's router (Megatron-Core's TopKRouter): a linear gate from hidden states to one logit per expert,
the routing of `routing.py`, token dropping at the expert capacity, and the auxiliary losses attached to the
routing weights (`aux_losses.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.init import init_method_normal
from megatron_train.models.moe.aux_losses import (
    BACKWARD_SCALE,
    METRICS,
    AuxLossAutoScaler,
    scores_for_aux_loss,
    switch_load_balancing_loss,
    z_loss,
)
from megatron_train.models.moe.config import AUX_LOSS_NAMES
from megatron_train.models.moe.routing import drop_tokens, sinkhorn_routing, topk_routing
from megatron_train.parallel import state
from megatron_train.parallel.param_init import new_buffer, new_parameter
from megatron_train.parallel.random import is_recomputing

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class TopKRouter(nn.Module):
    """Routes each token to `--moe-router-topk` experts. `weight` [experts, hidden] (and `bias` with linear biases)
    is replicated over TP; under sequence parallelism each TP rank routes its own tokens, so the weight's gradient
    is summed over TP (`sequence_parallel`). With --moe-router-enable-expert-bias, `expert_bias` (fp32, saved) is
    moved after each step by `end_of_step` from the tokens counted in `local_tokens_per_expert`. Token counts are
    summed over the ranks holding the rest of a micro-batch's tokens (`pg_collection.tp_cp`) or of the step's
    (`tp_dp_cp`)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        sequence_parallel: bool,
        pg_collection: state.ProcessGroupCollection,
    ) -> None:
        super().__init__()
        self.tp_cp_group, self.tp_dp_cp_group = pg_collection.tp_cp, pg_collection.tp_dp_cp
        self.config = config
        self.layer_number = layer_number
        self.topk = config.moe_router_topk
        self.num_experts = config.num_experts
        # replicated over every rank: drawn from the default generator (parallel.param_init)
        dtype = config.params_dtype
        self.weight = new_parameter(
            (config.num_experts, config.hidden_size), dtype, init_method_normal(config.init_method_std)
        )
        self.bias = None
        if config.add_bias_linear:
            self.bias = new_parameter((config.num_experts,), dtype, nn.init.zeros_)
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel
        if config.moe_router_enable_expert_bias:
            self.register_buffer(
                "expert_bias", new_buffer((config.num_experts,), torch.float32, nn.init.zeros_)
            )
            self.register_buffer(
                "local_tokens_per_expert",
                new_buffer((config.num_experts,), torch.float32, nn.init.zeros_),
                persistent=False,
            )
        else:
            self.expert_bias = None
        self.aux_loss_coeffs = config.aux_loss_coeffs()
        self.global_tokens_per_expert: torch.Tensor | None = None  # global_aux_loss: summed over the step
        self.global_steps = 0

    def gating(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [tokens, experts] in --moe-router-dtype (the input's dtype by default)."""
        dtype = ROUTER_DTYPES.get(self.config.moe_router_dtype, hidden.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(hidden.to(dtype), self.weight.to(dtype), bias)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [s, b, h] (this rank's sequence shard under SP) -> (probs, routing_map), each [s * b, experts]."""
        seq, batch = hidden.shape[:2]
        logits = self.gating(hidden.reshape(-1, hidden.shape[-1]))
        training = self.training and torch.is_grad_enabled()
        if training and self.config.moe_z_loss_coeff is not None:
            logits = self._attach_z_loss(logits)
        config = self.config
        if config.moe_router_load_balancing_type == ["sinkhorn"]:
            probs, routing_map = sinkhorn_routing(logits, self.topk, self.training)
        else:
            probs, routing_map = topk_routing(
                logits,
                self.topk,
                config.moe_router_score_function,
                config.moe_router_pre_softmax,
                config.moe_router_num_groups,
                config.moe_router_group_topk,
                config.moe_router_topk_scaling_factor,
                self.expert_bias,
            )
        if config.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_tokens(
                probs,
                routing_map,
                self.topk,
                config.moe_expert_capacity_factor,
                config.moe_token_drop_policy,
                config.moe_pad_expert_input_to_capacity,
            )
        if training and self.aux_loss_coeffs:
            probs = self._attach_load_balancing_losses(probs, logits, seq, batch)
        if training and not is_recomputing():
            with torch.no_grad():
                METRICS.record("tokens_per_expert", routing_map.sum(dim=0).float(), self.layer_number)
                if self.expert_bias is not None:
                    self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def _record(self, name: str, value: torch.Tensor) -> None:
        """Record a loss for the logs, once per micro-batch (not again when a checkpointed layer is recomputed)."""
        if not is_recomputing():
            METRICS.record(name, value, self.layer_number)

    def _attach(self, tensor: torch.Tensor, loss: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """`tensor` with `loss`'s gradient attached (per-token-loss runs scale it by the tokens the TP x CP group
        routed, which the per-token division takes back out)."""
        if BACKWARD_SCALE.per_token:
            loss = loss * num_tokens * state.group_size(self.tp_cp_group)
        return AuxLossAutoScaler.apply(tensor, loss)

    def _attach_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """The z-loss of this rank's tokens, averaged over the TP x CP ranks' shares of the micro-batch."""
        coeff = self.config.moe_z_loss_coeff / state.group_size(self.tp_cp_group)
        loss = z_loss(logits, coeff)
        self._record("z_loss", loss / coeff)
        return self._attach(logits, loss, logits.shape[0])

    def _attach_load_balancing_losses(
        self, probs: torch.Tensor, logits: torch.Tensor, seq: int, batch: int
    ) -> torch.Tensor:
        """aux_loss over the micro-batch, seq_aux_loss per sequence (averaged over the batch), global_aux_loss over
        every token routed so far this step; token counts summed over the ranks holding the other tokens."""
        routing_map, scores = scores_for_aux_loss(logits, self.topk, self.config.moe_router_score_function)
        tokens_per_expert = routing_map.sum(dim=0).float()
        tp_cp, tp_dp_cp = state.group_size(self.tp_cp_group), state.group_size(self.tp_dp_cp_group)
        for kind, coeff in self.aux_loss_coeffs.items():
            if kind == "aux_loss":
                counts = _summed(tokens_per_expert, self.tp_cp_group)
                loss = switch_load_balancing_loss(
                    scores, counts, logits.shape[0] * tp_cp, self.topk, self.num_experts, coeff
                )
            elif kind == "seq_aux_loss":
                # experts x sequences as "experts": the loss of each sequence summed, then averaged
                per_sequence = routing_map.view(seq, batch * self.num_experts).sum(dim=0).float()
                counts = _summed(per_sequence, self.tp_cp_group)
                loss = (
                    switch_load_balancing_loss(
                        scores.view(seq, -1), counts, seq * tp_cp, self.topk, self.num_experts, coeff
                    )
                    / batch
                )
            else:
                if not is_recomputing():  # the recomputed pass reuses the counts that include its tokens
                    counts = _summed(tokens_per_expert, self.tp_dp_cp_group)
                    if self.global_tokens_per_expert is None:
                        self.global_tokens_per_expert = torch.zeros_like(counts)
                    self.global_tokens_per_expert += counts
                    self.global_steps += 1
                loss = switch_load_balancing_loss(
                    scores, self.global_tokens_per_expert / self.global_steps,
                    logits.shape[0] * tp_dp_cp, self.topk, self.num_experts, coeff,
                )  # fmt: skip
            self._record(AUX_LOSS_NAMES[kind], loss / coeff)
            probs = self._attach(probs, loss, logits.shape[0])
        return probs

    def end_of_step(self) -> None:
        """After a step's gradients: move the expert bias towards balance (the counts summed over TP x CP x DP, so
        every replica moves it alike) and forget the step's global token counts."""
        self.global_tokens_per_expert, self.global_steps = None, 0
        if self.expert_bias is None:
            return
        counts = _summed(self.local_tokens_per_expert, self.tp_dp_cp_group)
        self.expert_bias += torch.sign(counts.mean() - counts) * self.config.moe_router_bias_update_rate
        self.local_tokens_per_expert.zero_()


def _summed(counts: torch.Tensor, group: torch.distributed.ProcessGroup | None) -> torch.Tensor:
    """`counts` summed over `group` (a copy; the gradient does not flow through counts)."""
    counts = counts.detach().clone()
    if state.group_size(group) > 1:
        torch.distributed.all_reduce(counts, group=group)
    return counts
