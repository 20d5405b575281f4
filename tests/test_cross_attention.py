"""Cross-attention (T5's decoder, Retro's chunked cross-attention): the attention worked out by hand, the layer's
parameter names, and a block of cross-attention layers under TP=2 (+SP) equal to one process."""

from __future__ import annotations

import pytest
import torch

from megatron_train.models.cross_attention import CrossAttention
from megatron_train.models.transformer import TransformerBlock
from megatron_train.parallel import allreduce_sequence_parallel_grads, mappings, state
from tests.helpers.distributed import run_distributed
from tests.helpers.tensors import full_tensor, relative_error
from tests.helpers.tiny import tiny_config, tiny_llama_config

S_Q, S_K, BATCH = 8, 12, 2


def _inputs(hidden_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(S_Q, BATCH, hidden_size, generator=generator)
    context = torch.randn(S_K, BATCH, hidden_size, generator=generator)
    mask = torch.ones(BATCH, 1, 1, S_K, dtype=torch.bool)
    mask[1, ..., 9:] = False  # the second sample's context is padded after 9 positions
    return hidden, context, mask


@pytest.mark.parametrize("masked", [False, True])
def test_cross_attention_equals_attention_worked_out_by_hand(masked):
    config = tiny_llama_config()  # grouped-query: 8 heads over 4 key/value groups
    torch.manual_seed(0)
    attention = CrossAttention(config, sequence_parallel=False)
    hidden, context, mask = _inputs(config.hidden_size)
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    q = (hidden @ attention.linear_q.weight.T).view(S_Q, BATCH, heads, d)
    kv = (context @ attention.linear_kv.weight.T).view(S_K, BATCH, groups, 2, d)
    k, v = (kv[:, :, :, i].repeat_interleave(heads // groups, dim=2) for i in (0, 1))
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / d**0.5
    if masked:
        scores = scores.masked_fill(~mask, float("-inf"))
    context_layer = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v).reshape(S_Q, BATCH, heads * d)
    expected = context_layer @ attention.linear_proj.weight.T
    actual = attention(hidden, context, mask if masked else None)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_cross_attention_is_not_causal():
    """Every query sees every context position: changing the last context token changes the first output."""
    config = tiny_config()
    attention = CrossAttention(config, sequence_parallel=False)
    hidden, context, _ = _inputs(config.hidden_size)
    changed = context.clone()
    changed[-1] += 1.0
    assert not torch.allclose(attention(hidden, context)[0], attention(hidden, changed)[0])


@pytest.mark.parametrize("post_ln", [False, True])
def test_cross_attention_layers_are_named_as_megatron_core(post_ln):
    config = tiny_config(post_ln=post_ln)
    block = TransformerBlock(
        config, False, post_process=True, cross_attention_for=lambda layer: CrossAttention(config, False)
    )
    names = {name.split(".", 2)[2] for name in block.state_dict() if name.startswith("layers.0.")}
    norm = "post_cross_attn_layernorm" if post_ln else "pre_cross_attn_layernorm"
    assert {f"{norm}.weight", "cross_attention.linear_q.weight", "cross_attention.linear_kv.weight",
            "cross_attention.linear_proj.weight"} <= names  # fmt: skip
    plain = TransformerBlock(config, False, post_process=True)
    assert not any("cross" in name for name in plain.state_dict())


def _block_loss_and_grads(config, sequence_parallel: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    block = (
        TransformerBlock(  # the same full weights under every TP size (--use-cpu-initialization's streams)
            config,
            sequence_parallel,
            post_process=True,
            init_seed=1234,
            cross_attention_for=lambda layer: (
                CrossAttention(config, sequence_parallel) if layer == 1 else None
            ),
        )
    )
    hidden, context, mask = _inputs(config.hidden_size)
    if sequence_parallel:
        hidden = mappings.scatter_to_sequence_parallel_region(hidden)
        context = mappings.scatter_to_sequence_parallel_region(context)
    out = block(hidden, context=context, context_mask=mask)
    if sequence_parallel:
        out = mappings.gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    loss.backward()
    allreduce_sequence_parallel_grads(block)
    return loss.detach(), {name: full_tensor(p.grad, p) for name, p in block.named_parameters()}


def _tensor_parallel_worker(rank: int, world_size: int) -> dict[str, tuple[float, float]]:
    results = {}
    for name, config in (("gpt", tiny_config()), ("llama_gqa", tiny_llama_config())):
        reference_loss, reference_grads = _block_loss_and_grads(config, False)
        for sequence_parallel in (False, True):
            state.initialize_model_parallel(tensor_model_parallel_size=2)
            loss, grads = _block_loss_and_grads(config, sequence_parallel)
            grad_error = max(relative_error(grads[key], reference_grads[key]) for key in reference_grads)
            results[f"{name}_sp{int(sequence_parallel)}"] = (
                relative_error(loss, reference_loss),
                grad_error,
            )
            state.destroy_model_parallel()
    return results


@pytest.mark.processes
def test_cross_attention_block_under_tensor_and_sequence_parallel_equals_one_process():
    results = run_distributed(_tensor_parallel_worker, 2)[0]
    assert len(results) == 4
    for case, (loss_error, grad_error) in results.items():
        assert loss_error < 1e-5, case
        assert grad_error < 1e-5, case
