"""How a router's logits become routing weights: top-k with a softmax or sigmoid score, group-limited top-k,
Sinkhorn balancing, and expert capacity with token dropping (Megatron-Core's moe_utils, without fused kernels).

Every function takes logits [tokens, experts] and returns (probs [tokens, experts], routing_map [tokens, experts]):
the weight of each chosen expert (0 elsewhere) and which experts each token goes to.
"""

from __future__ import annotations

import math

import torch


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to `group_topk` of `num_groups` expert groups (DeepSeek's device/node-limited routing): a
    group's score is the sum of its best topk / group_topk scores; the top groups' experts compete for the k."""
    tokens, experts = scores.shape
    group_scores = scores.view(tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_index = group_scores.topk(group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_index, True)
    expert_mask = (
        group_mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, -1)
    )
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's `topk_routing_with_score_function`. softmax: the top k logits' softmax (Mixtral), or with
    `pre_softmax` the top k of a softmax over all experts (weights not renormalised). sigmoid: the top k sigmoid
    scores normalised to sum 1 (k > 1); `expert_bias` shifts only which experts are chosen. Scores are computed in
    fp32; the weights come back in the logits' dtype."""

    def choose(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            return group_limited_topk(scores, topk, num_groups, group_topk)
        return scores.topk(topk, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            probs, indices = choose(torch.softmax(logits, dim=-1, dtype=torch.float32))
        else:
            chosen, indices = choose(logits)
            probs = torch.softmax(chosen, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        if expert_bias is not None:
            _, indices = choose(scores + expert_bias.float())
            chosen = scores.gather(1, indices)
        else:
            chosen, indices = choose(scores)
        probs = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else chosen
    else:
        raise ValueError(f"--moe-router-score-function {score_function!r}: choose softmax or sigmoid")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs.type_as(logits))
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_probs, routing_map


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp on exp(cost): row and column scalings alternated until the column scaling moves less than
    `tol`, so every expert ends up with about the same total weight (S-BASE; Megatron's `sinkhorn`)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's sinkhorn load balancing: in training the experts are chosen on the Sinkhorn-balanced logits (no
    gradient), weighted by the plain scores (sigmoid for k = 1, else softmax); in evaluation by the scores."""
    scores = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, dim=-1, dtype=torch.float32)
    scores = scores.type_as(logits)
    if training:
        with torch.no_grad():
            indices = sinkhorn(logits.float()).topk(topk, dim=1)[1]
    else:
        indices = scores.topk(topk, dim=1)[1]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return scores * routing_map, routing_map


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens one expert takes: ceil(tokens x top k / experts x capacity factor) (Megatron's `get_capacity`)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def drop_tokens(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    capacity_factor: float,
    policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert keeps at most its capacity of the tokens routed to it: those of the highest weights (`probs`
    policy) or the first ones in order (`position`); the others lose that expert. With `pad_to_capacity` every
    expert takes exactly its capacity, filled up with tokens not routed to it (weight 0), as Megatron does."""
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, topk, capacity_factor)
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    elif policy == "probs":
        keep = torch.zeros_like(routing_map).scatter(0, probs.topk(capacity, dim=0, sorted=False)[1], True)
    elif policy == "position":
        # the first `capacity` routed tokens of each expert, then (padding) the first tokens not routed to it
        order = (
            torch.where(routing_map, 0, num_tokens) + torch.arange(num_tokens, device=probs.device)[:, None]
        )
        keep = torch.zeros_like(routing_map).scatter(0, order.topk(capacity, dim=0, largest=False)[1], True)
    else:
        raise ValueError(f"--moe-token-drop-policy {policy!r}: choose probs or position")
    kept = keep if pad_to_capacity else routing_map & keep
    return probs * kept, kept
