"""The routers' auxiliary losses and their bookkeeping (Megatron-Core's moe_utils and moe_logging).

A load-balancing loss is not added to the LM loss: `AuxLossAutoScaler` attaches it to the routing weights, so its
gradient (scaled as the LM loss is, by `set_backward_scale` each step) flows in the same backward pass, on every
pipeline stage. Its value, divided by its coefficient, is recorded per layer in `MoEMetrics`, which sums a
step's micro-batches, reduces them over the ranks that saw parts of the same tokens and reports Megatron's names
(`load_balancing_loss`, `seq_load_balancing_loss`, `global_load_balancing_loss`, `z_loss`), averaged over the MoE
layers, for the iteration line and TensorBoard; per layer (and per expert token counts) with
--moe-per-layer-logging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_train.parallel import state


def switch_load_balancing_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """Switch Transformer's loss, E / (k T^2) x sum_i (sum_x p_i(x)) (tokens routed to i) x coeff: with f_i the
    share of routings that go to expert i and P_i its mean score, coeff x E x sum_i f_i P_i. `probs` [tokens,
    experts] are this rank's scores; `tokens_per_expert` and `total_num_tokens` may count more ranks' tokens (the
    TP/CP group's, the global batch's): summing every rank's loss then gives the loss of all their tokens."""
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    )


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: coeff x mean over tokens of logsumexp(logits)^2 (keeps the logits small)."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing map, scores) the load-balancing losses are computed on: the top k of the full softmax (or of the
    sigmoid scores normalised per token), whatever routing chose (Megatron's compute_routing_scores_for_aux_loss)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, scores.topk(topk, dim=1)[1], True)
    return routing_map, scores


@dataclass
class BackwardScale:
    """What an auxiliary loss's gradient is multiplied by: the LM loss's (the loss scale over the micro-batches,
    set each step); with --calculate-per-token-loss the router also multiplies its losses by its token count
    (Megatron's rule; see training/per_token_loss.py)."""

    scale: float = 1.0
    per_token: bool = False


BACKWARD_SCALE = BackwardScale()


def set_backward_scale(scale: float, per_token: bool = False) -> None:
    """Called by the training step before its micro-batches: `scale` is the loss scale / micro-batches."""
    BACKWARD_SCALE.scale, BACKWARD_SCALE.per_token = scale, per_token


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output`; in the backward pass the attached `aux_loss` gets the gradient `BACKWARD_SCALE.scale`,
    as if it had been added to the (scaled) LM loss (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, BACKWARD_SCALE.scale)


# How each recorded metric is reduced across ranks, after summing the pipeline stages' layers: (group summed over,
# group averaged over), fields of the ProcessGroupCollection. A micro-batch's aux loss is split over the TP x CP
# ranks holding parts of its tokens, then averaged over DP; the global one already counts every token of the step;
# the z-loss is a mean over tokens.
REDUCTIONS = {
    "load_balancing_loss": ("tp_cp", "dp"),
    "seq_load_balancing_loss": ("tp_cp", "dp"),
    "global_load_balancing_loss": ("tp_dp_cp", None),
    "z_loss": (None, "tp_dp_cp"),
    "tokens_per_expert": ("tp_dp_cp", None),
}


class MoEMetrics:
    """Per-layer sums over a step's micro-batches of each router's losses (and of its tokens per expert), reduced
    and reported once per step by every rank (`report` runs collectives)."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def start(self, names: list[str], num_layers: int, num_experts: int, device: torch.device) -> None:
        """Track `names` for a model of `num_layers` layers: zeros on every rank, also on pipeline stages without
        MoE layers, so every rank reduces the same tensors."""
        self.values = {name: torch.zeros(num_layers, device=device) for name in names}
        self.values["tokens_per_expert"] = torch.zeros(num_layers, num_experts, device=device)

    def record(self, name: str, value: torch.Tensor, layer: int) -> None:
        """Add a micro-batch's `value` of metric `name` at global layer `layer` (0-based); untracked names (no
        training run started the metrics: evaluation, a model used alone) are ignored."""
        if name in self.values:
            self.values[name][layer] += value.detach().to(self.values[name].dtype)

    def report(
        self, num_micro_batches: int, num_moe_layers: int, pg_collection: state.ProcessGroupCollection
    ) -> tuple[dict[str, float], dict[str, float]]:
        """(each loss averaged over micro-batches and MoE layers, per-layer values and per-expert token counts) of
        the step, identical on every rank of `pg_collection`'s groups; the sums start again from zero."""
        means: dict[str, float] = {}
        per_layer: dict[str, float] = {}
        for name, values in self.values.items():
            summed_over, averaged_over = REDUCTIONS[name]
            _reduce(values, pg_collection.pp, dist.ReduceOp.SUM)
            _reduce(values, summed_over and getattr(pg_collection, summed_over), dist.ReduceOp.SUM)
            _reduce(values, averaged_over and getattr(pg_collection, averaged_over), dist.ReduceOp.AVG)
            if name == "tokens_per_expert":
                for (layer, expert), count in zip(_indices(values), values.flatten().tolist(), strict=True):
                    if values[layer].any():
                        per_layer[f"moe/tokens_per_expert_layer_{layer}_expert_{expert}"] = count
            else:
                values /= num_micro_batches
                means[name] = values.sum().item() / num_moe_layers
                per_layer.update({f"moe/{name}_layer_{i}": v for i, v in enumerate(values.tolist()) if v})
            values.zero_()
        return means, per_layer


def _indices(values: torch.Tensor) -> list[tuple[int, int]]:
    return [(layer, expert) for layer in range(values.shape[0]) for expert in range(values.shape[1])]


def _reduce(values: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp) -> None:
    if state.group_size(group) > 1:
        dist.all_reduce(values, op=op, group=group)


METRICS = MoEMetrics()
