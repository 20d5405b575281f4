"""Megatron's mixture-of-experts flags (`--num-experts`, `--moe-*`) as the `MoEConfig` part of `TransformerConfig`.

A model with `--num-experts` replaces the MLP of every layer `--moe-layer-freq` selects by an MoE layer
(`models.moe.layer.MoELayer`); the flags keep Megatron-Core's names, defaults and refusals. `--moe-layer-freq`
takes Megatron's forms: N (every N-th layer, from the first) or a pattern such as "([0]+[1]*3)*2" (one entry
per layer, 1 = MoE), which is parsed here as list arithmetic, never evaluated as Python.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Literal

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
# Load-balancing types that add a loss (each its own coefficient), logged under Megatron's names.
AUX_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}
TokenDispatcherType = Literal["allgather", "alltoall", "flex"]


def _help(text: str, **extra: object) -> dict:
    return {"help": text, **extra}


def parse_moe_layer_freq(text: str, num_layers: int) -> list[int]:
    """One 0/1 per layer (1: MoE) from Megatron's --moe-layer-freq: an int N (layers 0, N, 2N, ... are MoE) or a
    pattern of list literals of 0/1, `+` and `* <int>` with parentheses. The pattern is read from its syntax tree;
    nothing is evaluated."""
    text = str(text).strip()
    if text.lstrip("-").isdigit():
        every = int(text)
        if every < 1:
            raise ValueError(f"--moe-layer-freq {text}: the frequency must be >= 1 (1: every layer is MoE)")
        return [int(layer % every == 0) for layer in range(num_layers)]
    try:
        pattern = _pattern(ast.parse(text, mode="eval").body, text, num_layers)
    except SyntaxError as error:
        raise ValueError(
            f"--moe-layer-freq {text!r}: neither an integer nor a pattern such as '([0]+[1]*3)*2' ({error.msg})"
        ) from None
    except RecursionError:
        raise ValueError(f"--moe-layer-freq: a pattern nested too deeply ({len(text)} characters)") from None
    if len(pattern) != num_layers:
        raise ValueError(
            f"--moe-layer-freq {text!r} gives {len(pattern)} layers but --num-layers is {num_layers}; give one "
            "0/1 entry per layer"
        )
    return pattern


def pattern_text(pattern: list[int]) -> str:
    """A layer pattern as --moe-layer-freq takes it, one shell word: "[1,0,1]"."""
    return "[" + ",".join(str(int(entry)) for entry in pattern) + "]"


def _pattern(node: ast.expr, text: str, num_layers: int) -> list[int]:
    """The layers `node` describes; a part longer than the model is refused before it is built."""
    if isinstance(node, ast.List):
        values = [element.value for element in node.elts if isinstance(element, ast.Constant)]
        if len(values) == len(node.elts) and all(value in (0, 1) and type(value) is int for value in values):
            return values
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _at_most(
            _pattern(node.left, text, num_layers) + _pattern(node.right, text, num_layers), text, num_layers
        )
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        for items, times in ((node.left, node.right), (node.right, node.left)):
            if isinstance(times, ast.Constant) and type(times.value) is int and times.value >= 0:
                part = _pattern(items, text, num_layers)
                return _at_most(part * min(times.value, num_layers + 1), text, num_layers)
    raise ValueError(
        f"--moe-layer-freq {text!r}: a pattern is made of lists of 0 and 1 joined by + and repeated by * <integer> "
        f"(Megatron's form, e.g. '([0]+[1]*3)*2'); {ast.unparse(node)!r} is not"
    )


def _at_most(pattern: list[int], text: str, num_layers: int) -> list[int]:
    if len(pattern) > num_layers:
        raise ValueError(
            f"--moe-layer-freq {text!r} gives more than --num-layers {num_layers} layers; give one 0/1 entry per layer"
        )
    return pattern


@dataclass(kw_only=True)
class MoEConfig:
    """Mixture of experts (Megatron-Core's MoE): inert unless --num-experts is set."""

    num_experts: int | None = field(
        default=None, metadata=_help("Number of experts of each MoE layer (None: a dense model).")
    )
    moe_ffn_hidden_size: int | None = field(
        default=None, metadata=_help("Hidden size of each expert's MLP; default --ffn-hidden-size.")
    )
    moe_layer_freq: str = field(
        default="1",
        metadata=_help(
            "Which layers are MoE: N (every N-th layer, from the first) or a pattern with one 0/1 per layer, "
            "e.g. '([0]+[1]*3)*2'."
        ),
    )
    moe_router_topk: int = field(default=2, metadata=_help("Experts each token is routed to."))
    moe_router_score_function: Literal["softmax", "sigmoid"] = field(
        default="softmax", metadata=_help("Router scores: softmax or sigmoid of the router logits.")
    )
    moe_router_pre_softmax: bool = field(
        default=False,
        metadata=_help(
            "Softmax over all experts before choosing the top k (default: over the top k's logits)."
        ),
    )
    moe_router_topk_scaling_factor: float | None = field(
        default=None, metadata=_help("Multiply the chosen experts' routing weights by this.")
    )
    moe_router_dtype: Literal["fp32", "fp64"] | None = field(
        default=None, metadata=_help("Compute the router's logits and scores in this precision.")
    )
    moe_router_num_groups: int | None = field(
        default=None, metadata=_help("Group-limited routing: experts split into this many groups.")
    )
    moe_router_group_topk: int | None = field(
        default=None, metadata=_help("Group-limited routing: groups each token may use.")
    )
    moe_router_enable_expert_bias: bool = field(
        default=False,
        metadata=_help(
            "Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for choosing experts, "
            "moved after each step towards the mean load (sigmoid scores only)."
        ),
    )
    moe_router_bias_update_rate: float = field(
        default=1e-3, metadata=_help("Step of the expert bias update (--moe-router-enable-expert-bias).")
    )
    moe_router_load_balancing_type: list[str] = field(
        default_factory=lambda: ["aux_loss"],
        metadata=_help(
            "aux_loss (Switch/GShard), seq_aux_loss (per sequence, DeepSeek-V2), global_aux_loss (over the global "
            "batch), sinkhorn (S-BASE routing), or none; several types take one --moe-aux-loss-coeff each."
        ),
    )
    moe_aux_loss_coeff: list[float] = field(
        default_factory=lambda: [0.0],
        metadata=_help("Coefficient of each load-balancing loss (1e-2 is a usual start)."),
    )
    moe_z_loss_coeff: float | None = field(
        default=None, metadata=_help("Coefficient of the router z-loss (ST-MoE), e.g. 1e-3.")
    )
    moe_expert_capacity_factor: float | None = field(
        default=None,
        metadata=_help("Expert capacity = this x tokens x top k / experts; tokens beyond it are dropped."),
    )
    moe_token_drop_policy: Literal["probs", "position"] = field(
        default="probs",
        metadata=_help("Over capacity, keep the tokens with the highest routing weights, or the first ones."),
    )
    moe_pad_expert_input_to_capacity: bool = field(
        default=False,
        metadata=_help("Fill every expert to its capacity (needs --moe-expert-capacity-factor)."),
    )
    moe_token_dispatcher_type: TokenDispatcherType = field(
        default="allgather",
        metadata=_help("How tokens reach their experts' ranks: allgather or alltoall (flex needs DeepEP)."),
    )
    moe_shared_expert_intermediate_size: int | None = field(
        default=None,
        metadata=_help("Hidden size of the shared experts every token goes through (None: none)."),
    )
    moe_shared_expert_gate: bool = field(
        default=False,
        metadata=_help("Scale the shared experts' output by a learned sigmoid gate (Qwen2-MoE)."),
    )
    moe_shared_expert_overlap: bool = field(
        default=False,
        metadata=_help("Overlap the shared experts with the token exchange (a CUDA-stream option)."),
    )
    moe_grouped_gemm: bool = field(
        default=False,
        metadata=_help("Run all local experts in one grouped matmul (torch.nn.functional.grouped_mm)."),
    )
    moe_layer_recompute: bool = field(
        default=False, metadata=_help("Recompute the MoE layers' activations in the backward pass.")
    )
    moe_use_upcycling: bool = field(
        default=False,
        metadata=_help(
            "--load a dense checkpoint and start every expert from its MLP (Megatron's upcycling)."
        ),
    )
    moe_upcycling_granularity: int = field(
        default=1,
        metadata=_help("Experts per dense MLP in upcycling (only 1: each expert is the whole MLP)."),
    )

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def moe_layer_pattern(self) -> list[int]:
        """One 0/1 per layer: 1 where the layer's MLP is an MoE layer (all 0 for a dense model)."""
        if not self.is_moe:
            return [0] * self.num_layers
        return parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) is an MoE layer."""
        return self.is_moe and bool(self.moe_layer_pattern[layer])

    def aux_loss_coeffs(self) -> dict[str, float]:
        """{loss-adding load-balancing type: its coefficient}, for the types with a coefficient above 0."""
        pairs = zip(self.moe_router_load_balancing_type, self.moe_aux_loss_coeff, strict=True)
        return {kind: coeff for kind, coeff in pairs if kind in AUX_LOSS_NAMES and coeff > 0}

    def normalize_moe(self) -> None:
        """Megatron's readings of the flags (and of its checkpoints' args): 0 experts is none, a single load-balancing
        type or coefficient is a list of one, a coefficient list of one applies to every type, the expert size
        defaults to --ffn-hidden-size, a pattern list is written out."""
        if self.num_experts == 0:
            self.num_experts = None
        if isinstance(self.moe_router_load_balancing_type, str):
            self.moe_router_load_balancing_type = [self.moe_router_load_balancing_type]
        if isinstance(self.moe_aux_loss_coeff, int | float):
            self.moe_aux_loss_coeff = [float(self.moe_aux_loss_coeff)]
        if isinstance(self.moe_layer_freq, list):  # Megatron's args hold the pattern evaluated
            self.moe_layer_freq = pattern_text(self.moe_layer_freq)
        self.moe_layer_freq = str(self.moe_layer_freq)
        types, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if len(coeffs) == 1 and len(types) > 1:
            self.moe_aux_loss_coeff = coeffs * len(types)
        if self.is_moe and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor < 0:
            self.moe_expert_capacity_factor = None  # Megatron: a negative factor is dropless

    def moe_checks(self) -> list[tuple[bool, str]]:
        """(condition, message naming the flag) pairs TransformerConfig refuses on (Megatron's validate_args and
        TransformerConfig rules); none apply without --num-experts."""
        if not self.is_moe:
            return []
        types = self.moe_router_load_balancing_type
        topk, experts = self.moe_router_topk, self.num_experts
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        return [
            (experts >= 1, f"--num-experts must be >= 1, got {experts}"),
            (1 <= topk <= experts, f"--moe-router-topk {topk} must be between 1 and --num-experts {experts}"),
            (
                all(kind in LOAD_BALANCING_TYPES for kind in types),
                f"--moe-router-load-balancing-type {' '.join(types)}: choose from {', '.join(LOAD_BALANCING_TYPES)}",
            ),
            (
                len(self.moe_aux_loss_coeff) == len(types),
                f"--moe-aux-loss-coeff gives {len(self.moe_aux_loss_coeff)} coefficients for {len(types)} "
                "--moe-router-load-balancing-type entries; give one, or one per type",
            ),
            (
                min(self.moe_aux_loss_coeff, default=0) >= 0 and (self.moe_z_loss_coeff or 0) >= 0,
                f"--moe-aux-loss-coeff {' '.join(map(str, self.moe_aux_loss_coeff))} / --moe-z-loss-coeff "
                f"{self.moe_z_loss_coeff}: a loss coefficient must be >= 0 (0 turns the loss off)",
            ),
            (
                "sinkhorn" not in types or (types == ["sinkhorn"] and not any(self.moe_aux_loss_coeff)),
                "--moe-router-load-balancing-type sinkhorn balances by itself: it takes no other type and no "
                "--moe-aux-loss-coeff",
            ),
            (
                not (topk == 1 and self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax
                     and types != ["sinkhorn"]),
                "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax (a softmax over one logit is "
                "1 and gives the router no gradient)",
            ),
            (
                not self.moe_router_enable_expert_bias or self.moe_router_score_function == "sigmoid",
                "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid",
            ),
            (
                (groups is None) == (group_topk is None),
                "group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk",
            ),
            (
                groups is None or (experts % groups == 0 and 1 <= group_topk <= groups and topk % group_topk == 0),
                f"--moe-router-num-groups {groups} must divide --num-experts {experts}, and --moe-router-group-topk "
                f"{group_topk} must be at most the groups and divide --moe-router-topk {topk}",
            ),
            (
                self.moe_expert_capacity_factor is None or "sinkhorn" not in types,
                "--moe-expert-capacity-factor works with aux_loss, seq_aux_loss, global_aux_loss or none load "
                "balancing, not sinkhorn",
            ),
            (
                not self.moe_pad_expert_input_to_capacity or self.moe_expert_capacity_factor is not None,
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
            ),
            (
                not self.moe_shared_expert_gate or self.moe_shared_expert_intermediate_size is not None,
                "--moe-shared-expert-gate gates the shared experts: it needs --moe-shared-expert-intermediate-size",
            ),
            (
                (self.moe_shared_expert_intermediate_size or 1) > 0 and self.moe_ffn_hidden_size > 0,
                "--moe-ffn-hidden-size and --moe-shared-expert-intermediate-size must be > 0",
            ),
            (
                self.moe_token_dispatcher_type != "flex",
                "--moe-token-dispatcher-type flex runs DeepEP / HybridEP's fused GPU kernels, which this engine does "
                "not have; use --moe-token-dispatcher-type alltoall",
            ),
            (
                self.moe_upcycling_granularity == 1,
                f"--moe-upcycling-granularity {self.moe_upcycling_granularity}: only 1 (each expert a copy of the "
                "dense MLP) is implemented",
            ),
        ]  # fmt: skip
