"""The MoE router, its losses and the MoE layer in one process: the aux, seq-aux and z losses equal their formulas on
hand-checked cases and reach the gradient as the LM loss does, token dropping at capacity 1.0 drops exactly the
tokens a reference computation says (both policies, and padding to capacity), Sinkhorn balances, the expert bias
moves towards balance, the padded bmm and grouped_mm equal the loop over experts, and the MoE flags parse and refuse as Megatron's."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_train.arguments import parse_args
from megatron_train.models.moe.aux_losses import (
    METRICS,
    scores_for_aux_loss,
    set_backward_scale,
    switch_load_balancing_loss,
    z_loss,
)
from megatron_train.models.moe.config import parse_moe_layer_freq
from megatron_train.models.moe.dispatcher import permute, unpermute
from megatron_train.models.moe.experts import grouped_mm_refusal
from megatron_train.models.moe.layer import MoELayer
from megatron_train.models.moe.router import TopKRouter
from megatron_train.models.moe.routing import (
    drop_tokens,
    expert_capacity,
    sinkhorn,
    sinkhorn_routing,
    topk_routing,
)
from megatron_train.parallel.state import process_groups
from tests.helpers.tiny import tiny_config

P = torch.tensor([[0.75, 0.25], [0.75, 0.25], [0.25, 0.75], [0.75, 0.25]])


def _router(logits: torch.Tensor, **moe) -> TopKRouter:
    """A router over 2-dim hidden states whose gate reproduces `logits` for the one-hot tokens."""
    config = tiny_config(
        hidden_size=logits.shape[0], num_attention_heads=1, num_experts=logits.shape[1], **moe
    )
    router = TopKRouter(config, layer_number=0, sequence_parallel=False, pg_collection=process_groups())
    with torch.no_grad():
        router.weight.copy_(logits.t())
        router.bias.zero_()
    return router


def test_aux_loss_is_experts_times_routed_share_times_mean_score():
    """4 tokens, 2 experts, top 1: shares f = (3/4, 1/4), mean scores P = (0.625, 0.375): E sum f P = 1.125."""
    routing_map, scores = scores_for_aux_loss(P.log(), 1, "softmax")
    torch.testing.assert_close(scores, P)
    loss = switch_load_balancing_loss(scores, routing_map.sum(0).float(), 4, 1, 2, coeff=1.0)
    assert loss.item() == pytest.approx(2 * (0.75 * 0.625 + 0.25 * 0.375)) == pytest.approx(1.125)


def test_router_records_aux_seq_aux_and_z_losses_and_attaches_them_with_the_loss_scale():
    """Tokens [s=2, b=2] (row = s * 2 + b): sequence 0 (rows 0, 2) sends both tokens to expert 0 at 0.75:
    E f P = 2 (1 x 0.75) = 1.5; sequence 1 one to each: 2 (0.5 x 0.5 + 0.5 x 0.5) = 1.0; seq-aux = 1.25. The batch's
    aux loss is 1.125 (above). z-loss: mean over tokens of logsumexp(logits)^2."""
    order = [0, 2, 1, 3]  # rows 0 and 2 are tokens 0, 1 of P (both expert 0); rows 1, 3 are tokens 2, 3
    logits = P.log()[order]
    router = _router(
        torch.eye(4) @ logits,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
        moe_aux_loss_coeff=[0.1, 0.2],
        moe_z_loss_coeff=0.01,
    )
    METRICS.start(["load_balancing_loss", "seq_load_balancing_loss", "z_loss"], 1, 2, torch.device("cpu"))
    set_backward_scale(0.5)
    hidden = torch.eye(4).view(2, 2, 4).requires_grad_(True)
    probs, routing_map = router(hidden)
    assert routing_map[:, 0].tolist() == [True, False, True, True]
    losses, _ = METRICS.report(1, 1, process_groups())
    z = torch.logsumexp(logits, dim=-1).square().mean().item()
    assert losses == pytest.approx(
        {"load_balancing_loss": 1.125, "seq_load_balancing_loss": 1.25, "z_loss": z}
    )
    # the gradient of the weights is that of sum(probs) + 0.5 x (0.1 aux + 0.2 seq-aux + 0.01 z)
    probs.sum().backward()
    expected = torch.autograd.grad(
        _reference_objective(router, hidden.detach(), 0.5 * torch.tensor([0.1, 0.2, 0.01])), router.weight
    )[0]
    torch.testing.assert_close(router.weight.grad, expected)


def _reference_objective(router: TopKRouter, hidden: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    logits = router.gating(hidden.reshape(-1, 4))
    probs = torch.softmax(logits, -1) * torch.nn.functional.one_hot(logits.argmax(-1), 2)
    scores = torch.softmax(logits, -1)
    counts = torch.nn.functional.one_hot(scores.argmax(-1), 2).sum(0).float()
    aux = switch_load_balancing_loss(scores, counts, 4, 1, 2, 1.0)
    per_sequence = [
        switch_load_balancing_loss(scores[rows], counts_of(scores[rows]), 2, 1, 2, 1.0)
        for rows in ([0, 2], [1, 3])
    ]
    seq = sum(per_sequence) / 2
    return probs.sum() + scales[0] * aux + scales[1] * seq + scales[2] * z_loss(logits, 1.0)


def counts_of(scores: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[1]).sum(0).float()


def test_z_loss_is_the_mean_squared_logsumexp():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # logsumexp: log 2, log 4
    assert z_loss(logits, 0.5).item() == pytest.approx(0.5 * 2.5 * math.log(2.0) ** 2)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_1_keeps_exactly_the_tokens_a_reference_keeps(policy, pad):
    """8 tokens, 4 experts, top 2: capacity ceil(8 x 2 / 4 x 1.0) = 4 tokens an expert."""
    torch.manual_seed(0)
    logits = torch.randn(8, 4) + torch.tensor([2.0, 1.0, 0.0, -1.0])  # expert 0 wanted by most tokens
    probs, routing_map = topk_routing(logits, 2)
    kept_probs, kept = drop_tokens(probs, routing_map, 2, 1.0, policy, pad)
    capacity = expert_capacity(8, 4, 2, 1.0)
    assert capacity == 4 and routing_map[:, 0].sum() > capacity  # something is dropped
    for expert in range(4):
        routed = [t for t in range(8) if routing_map[t, expert]]
        if policy == "probs":
            routed.sort(key=lambda t: -probs[t, expert].item())
        keep = set(routed[:capacity])
        chosen = {t for t in range(8) if kept[t, expert]}
        if not pad:
            assert chosen == keep, expert
            continue
        # filled up to capacity with tokens not routed to the expert, which weigh 0: the first ones by position,
        # any of them by probability (all 0)
        assert len(chosen) == capacity and keep <= chosen, expert
        others = [t for t in range(8) if not routing_map[t, expert]]
        if policy == "position":
            assert chosen == keep | set(others[: capacity - len(keep)]), expert
    torch.testing.assert_close(kept_probs, probs * kept)


def test_moe_layer_output_is_the_kept_experts_weighted_sum():
    """With capacity 1.0 a dropped token gets nothing from that expert: the layer equals the sum over kept
    (token, expert) pairs of weight x expert MLP, whichever dispatcher and expert path runs it."""
    config = tiny_config(
        num_experts=4, moe_ffn_hidden_size=16, moe_expert_capacity_factor=1.0, add_bias_linear=False
    )
    torch.manual_seed(1)
    layer = MoELayer(config, 0, sequence_parallel=False).eval()
    hidden = torch.randn(8, 2, 32)
    with torch.no_grad():
        probs, routing_map = layer.router(hidden)
        out = layer(hidden)
    tokens = hidden.reshape(-1, 32)
    expected = torch.zeros_like(tokens)
    experts = layer.experts
    for t, e in routing_map.nonzero().tolist():
        mlp = torch.nn.functional.gelu(tokens[t] @ experts.weight1[e]) @ experts.weight2[e]
        expected[t] += probs[t, e] * mlp
    assert routing_map.sum() < 16 * 2  # tokens were dropped
    torch.testing.assert_close(out.reshape(-1, 32), expected, rtol=1e-5, atol=1e-6)


def test_sinkhorn_balances_every_expert_and_its_routing_spreads_skewed_tokens():
    torch.manual_seed(2)
    logits = torch.randn(64, 8) + torch.linspace(3, 0, 8)  # most tokens prefer the first experts
    balanced = sinkhorn(logits)
    torch.testing.assert_close(balanced.sum(0), torch.full((8,), 1 / 8), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(balanced.sum(1), torch.full((64,), 1 / 64), rtol=1e-3, atol=1e-4)
    _, plain = topk_routing(logits, 1, pre_softmax=True)
    _, routed = sinkhorn_routing(logits, 1, training=True)
    assert plain.sum(0).max() > 20 and routed.sum(0).max() <= 12  # 8 a piece when perfectly balanced


def test_expert_bias_moves_against_the_load():
    router = _router(torch.zeros(4, 2), moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_topk=1, moe_router_bias_update_rate=0.01)  # fmt: skip
    router.local_tokens_per_expert.copy_(torch.tensor([3.0, 1.0]))
    router.end_of_step()
    assert router.expert_bias.tolist() == pytest.approx([-0.01, 0.01])
    assert router.local_tokens_per_expert.tolist() == [0.0, 0.0]
    assert "expert_bias" in router.state_dict() and "local_tokens_per_expert" not in router.state_dict()


@pytest.mark.parametrize("swiglu", [False, True])
def test_bmm_and_grouped_mm_equal_the_loop_over_experts_forward_and_backward(swiglu):
    """--moe-grouped-gemm on CPU: balanced rows run as one padded bmm, unbalanced ones (padding would add more than a
    quarter) through grouped_mm; both equal the loop over experts, an expert without tokens included."""
    torch.manual_seed(3)
    config = tiny_config(num_experts=4, moe_ffn_hidden_size=16, swiglu=swiglu, moe_grouped_gemm=True)
    layer = MoELayer(config, 0, sequence_parallel=False)
    for counts, kernel in (([5, 0, 4, 3], "grouped_mm"), ([4, 3, 4, 4], "bmm")):
        tokens = torch.randn(sum(counts), 32)
        assert grouped_mm_refusal(tokens, layer.experts.weight1) is None
        grads = []
        for grouped in (True, False):
            layer.experts.grouped_gemm = grouped
            assert layer.experts.kernel(tokens, counts) == (kernel if grouped else "loop")
            layer.zero_grad()
            x = tokens.clone().requires_grad_(True)
            out = layer.experts(x, counts)
            out.pow(2).sum().backward()
            weights = layer.experts.weight1.grad.clone(), layer.experts.weight2.grad.clone()
            grads.append((out.detach(), x.grad, *weights))
        for grouped, looped in zip(*grads, strict=True):
            torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5)
    assert "not a multiple of 16 bytes" in grouped_mm_refusal(torch.randn(3, 6), torch.randn(2, 6, 5))


@pytest.mark.parametrize("dropped", [False, True])
def test_permute_and_unpermute_weight_each_route_and_sum_it_into_its_token(dropped):
    """Dropless (every token k routes: the per-token gather) and with dropped routes (index_add): experts scaling
    their rows by 1 + their index give sum_e probs[t, e] (1 + e) x[t], forward and backward, in float64."""
    torch.manual_seed(5)
    routing_map = torch.zeros(12, 4, dtype=torch.bool).scatter(1, torch.randn(12, 4).topk(2, dim=1)[1], True)
    if dropped:
        routing_map[::3] = False
    probs = torch.rand(12, 4, dtype=torch.float64) * routing_map
    results = []
    for ours in (True, False):
        x, p = (
            torch.randn(12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)),
            probs.clone(),
        )
        x.requires_grad_(True), p.requires_grad_(True)
        if ours:
            rows, routes = permute(x, routing_map, p)
            assert (routes.rows is None) == dropped
            out = unpermute(rows * (1 + routing_map.t().nonzero()[:, :1]), routes)
        else:
            out = x * (p * routing_map * (1 + torch.arange(4))).sum(dim=1, keepdim=True)
        out.backward(torch.linspace(-1, 1, 96, dtype=torch.float64).view(12, 8))
        results.append((out.detach(), x.grad, p.grad))
    for ours, expected in zip(*results, strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


def test_moe_layer_freq_patterns_parse_without_evaluating_them():
    assert parse_moe_layer_freq("2", 4) == [1, 0, 1, 0]
    assert parse_moe_layer_freq("([0]+[1]*2)*2", 6) == [0, 1, 1, 0, 1, 1]
    assert parse_moe_layer_freq("[1,0]*2", 4) == [1, 0, 1, 0]
    for bad, message in (
        ("__import__('os').system('true')", "a pattern is made of lists of 0 and 1"),
        ("[1, 2]", "a pattern is made of lists"),
        ("[1]*3", "gives 3 layers but --num-layers is 4"),
        ("([1]*100000)*100000", "gives more than --num-layers 4 layers"),  # refused before it is built
        ("+".join(["[1]"] * 5000), "nested too deeply"),
        ("([0]+", "neither an integer nor a pattern"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_moe_layer_freq(bad, 4)


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "world_size", "message"),
    [
        (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 splits MoE experts"),
        (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2, "--num-experts 3 is not a multiple"),
        (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--disable-bias-linear"], 2,
         "need --sequence-parallel"),
        (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], 1, "DeepEP / HybridEP"),
        (["--num-experts", "4", "--moe-enable-deepep"], 1, "--moe-enable-deepep asks for DeepEP"),
        (["--num-experts", "4", "--moe-router-topk", "1"], 1, "needs --moe-router-pre-softmax"),
        (["--num-experts", "4", "--moe-router-enable-expert-bias"], 1, "needs --moe-router-score-function sigmoid"),
        (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], 1, "needs --moe-expert-capacity-factor"),
        (["--num-experts", "4", "--moe-z-loss-coeff=-1e-3"], 1, "a loss coefficient must be >= 0"),
        (["--num-experts", "4", "--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "1"], 2,
         "biases only with --expert-tensor-parallel-size 1"),
        (["--num-experts", "4", "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 1,
         "--moe-router-num-groups 3 must divide --num-experts 4"),
    ],
)  # fmt: skip
def test_moe_flags_are_refused_naming_the_flag(flags, world_size, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, *flags], world_size=world_size)
    assert message in capsys.readouterr().err


def test_fused_moe_flags_are_accepted_with_a_line_saying_what_they_mean(caplog):
    caplog.set_level("INFO", logger="megatron_train.arguments")
    config = parse_args([*BASE, "--num-experts", "4", "--moe-permute-fusion", "--moe-router-fusion",
                         "--moe-shared-expert-overlap", "--moe-shared-expert-intermediate-size", "8"], world_size=1)  # fmt: skip
    assert config.model.num_experts == 4
    notes = {record.getMessage().split(":")[0] for record in caplog.records}
    assert {"--moe-permute-fusion", "--moe-router-fusion", "--moe-shared-expert-overlap"} <= notes
