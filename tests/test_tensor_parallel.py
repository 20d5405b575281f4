"""Tensor and sequence parallelism on real gloo process groups: collectives, vocab-parallel loss, RNG streams,
and the whole model under TP x SP equal to the single-process model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_train.models import GPTModel, KVCache, TransformerConfig
from megatron_train.parallel import (
    ColumnParallelLinear,
    ParallelConfig,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
    get_rng_tracker,
    mappings,
    model_parallel_seed,
    state,
    vocab_parallel_cross_entropy,
)
from megatron_train.parallel.random import initialization_stream
from tests.helpers.distributed import run_distributed
from tests.helpers.tensors import full_tensor, relative_error
from tests.helpers.tiny import TINY_LLAMA, TINY_MODEL, tiny_config, tiny_llama_config

VOCAB = 128


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return torch.randint(0, VOCAB, (2, 16), generator=generator), torch.randint(
        0, VOCAB, (2, 16), generator=generator
    )


def _loss_and_full_grads(model: GPTModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, labels = _batch()
    loss = model(ids, labels=labels)
    loss.mean().backward()
    allreduce_sequence_parallel_grads(model)
    return loss.detach(), {name: full_tensor(p.grad, p) for name, p in model.named_parameters()}


def _equivalence_worker(rank: int, world_size: int, cases: list[tuple[str, int, bool, dict]]) -> dict:
    """For each case: TP=1 reference and TP=tp model from the same full weights (--use-cpu-initialization's
    `init_seed`); max relative loss/grad errors."""
    results = {}
    for name, tp, sequence_parallel, config_kwargs in cases:
        config = TransformerConfig(**config_kwargs)
        reference_loss, reference_grads = _loss_and_full_grads(GPTModel(config, VOCAB, init_seed=1234))
        state.initialize_model_parallel(tensor_model_parallel_size=tp)
        model = GPTModel(config, VOCAB, sequence_parallel=sequence_parallel, init_seed=1234)
        loss, grads = _loss_and_full_grads(model)
        grad_errors = {key: relative_error(grads[key], reference_grads[key]) for key in reference_grads}
        worst = max(grad_errors, key=grad_errors.get)
        results[name] = (relative_error(loss, reference_loss), grad_errors[worst], worst)
        state.destroy_model_parallel()
    return results


EQUIVALENCE_CASES = [
    (f"{arch}_tp{tp}_sp{int(sp)}", tp, sp, kwargs)
    for arch, kwargs in (("gpt", TINY_MODEL), ("llama_gqa", TINY_LLAMA))
    for tp in (2, 4)
    for sp in (False, True)
] + [  # --add-qkv-bias (Qwen2): the fused bias is split across TP like the weight's rows, whole query groups
    (f"llama_qkv_bias_tp2_sp{int(sp)}", 2, sp, dict(TINY_LLAMA, add_qkv_bias=True)) for sp in (False, True)
]


@pytest.fixture(scope="module")
def equivalence_results() -> dict:
    return run_distributed(_equivalence_worker, 4, EQUIVALENCE_CASES)[0]


@pytest.mark.processes
@pytest.mark.parametrize("case", [name for name, *_ in EQUIVALENCE_CASES])
def test_tensor_and_sequence_parallel_losses_and_grads_equal_one_process(equivalence_results, case):
    loss_error, grad_error, worst = equivalence_results[case]
    assert loss_error < 1e-5
    assert grad_error < 1e-5, f"gradient of {worst} differs by {grad_error:.2e} (relative)"


def _check_mappings(rank: int) -> dict[str, float]:
    """Each mapping's forward and backward against the values worked out by hand, for TP=2 on rank `rank`."""
    x = torch.arange(4 * 2 * 6, dtype=torch.float32).view(4, 2, 6)
    weight = float(rank + 1)  # each rank weights its output differently, so summed gradients are visible
    errors = {}

    def check(name: str, forward, local_input: torch.Tensor, expected_out: torch.Tensor, expected_grad):
        leaf = local_input.clone().requires_grad_()
        out = forward(leaf)
        (out * weight).sum().backward()
        errors[name] = max(
            (out - expected_out).abs().max().item(), (leaf.grad - expected_grad).abs().max().item()
        )

    ones = torch.ones_like(x)
    by_rank_last = torch.cat([ones[..., :3], 2 * ones[..., 3:]], dim=-1)
    by_rank_first = torch.cat([ones[:2], 2 * ones[2:]], dim=0)
    last, first = slice(3 * rank, 3 * rank + 3), slice(2 * rank, 2 * rank + 2)
    check("copy_to_tp", mappings.copy_to_tensor_model_parallel_region, x, x, 3 * ones)
    check("reduce_from_tp", lambda t: mappings.reduce_from_tensor_model_parallel_region(t * weight), x, 3 * x,
          weight * weight * ones)  # fmt: skip
    check("scatter_to_tp", mappings.scatter_to_tensor_model_parallel_region, x, x[..., last], by_rank_last)
    check("gather_from_tp", mappings.gather_from_tensor_model_parallel_region, x[..., last], x,
          weight * ones[..., last])  # fmt: skip
    check("scatter_to_sp", mappings.scatter_to_sequence_parallel_region, x, x[first], by_rank_first)
    check("gather_from_sp", mappings.gather_from_sequence_parallel_region, x[first], x, 3 * ones[first])
    check("gather_from_sp_replicated", lambda t: mappings.gather_from_sequence_parallel_region(t, False), x[first],
          x, weight * ones[first])  # fmt: skip
    check("reduce_scatter_to_sp", lambda t: mappings.reduce_scatter_to_sequence_parallel_region(t * weight), x,
          3 * x[first], weight * by_rank_first)  # fmt: skip
    return errors


def _check_cross_entropy(rank: int) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(3, 2, 8, generator=generator)
    target = torch.randint(0, 8, (3, 2), generator=generator)
    loss_weights = torch.rand(3, 2, generator=generator)
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full.view(-1, 8), target.view(-1), reduction="none").view(3, 2)
    (expected * loss_weights).sum().backward()
    local = logits[..., 4 * rank : 4 * rank + 4].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target)
    (loss * loss_weights).sum().backward()
    grad_error = (local.grad - full.grad[..., 4 * rank : 4 * rank + 4]).abs().max().item()
    return (loss - expected).abs().max().item(), grad_error


def _gather_scalars(values: torch.Tensor) -> list[torch.Tensor]:
    gathered = [torch.empty_like(values) for _ in range(state.get_tensor_model_parallel_world_size())]
    dist.all_gather(gathered, values, group=state.get_tensor_model_parallel_group())
    return gathered


def _check_rng_streams() -> dict[str, bool]:
    model_parallel_seed(5)
    default_draw = torch.rand(4)
    with get_rng_tracker().fork():
        tracked_draw = torch.rand(4)
    after_fork = torch.rand(4)
    model_parallel_seed(5)
    torch.rand(4)
    with get_rng_tracker().fork():
        tracked_again = torch.rand(4)
    defaults, tracked = _gather_scalars(default_draw), _gather_scalars(tracked_draw)
    return {
        "default_stream_equal_across_tp": torch.equal(defaults[0], defaults[1]),
        "tracked_stream_differs_across_tp": not torch.equal(tracked[0], tracked[1]),
        "fork_leaves_default_stream_alone": torch.equal(
            _gather_scalars(after_fork)[0], _gather_scalars(after_fork)[1]
        ),
        "tracked_stream_reproducible": torch.equal(tracked_draw, tracked_again),
    }


def _recompute_error_under_tp(sequence_parallel: bool, recompute: dict) -> float:
    """TP=2 with dropout on: recompute vs none, same seeds -> max abs difference of loss and local grads."""
    runs = []
    for extra in ({}, recompute):
        config = tiny_llama_config(hidden_dropout=0.1, attention_dropout=0.1, **extra)
        torch.manual_seed(1234)
        model_parallel_seed(9)  # before the build: TP-split weights draw from the tracker's stream (sharded init)
        model = GPTModel(config, VOCAB, sequence_parallel=sequence_parallel).train()
        model_parallel_seed(9)
        ids, labels = _batch()
        loss = model(ids, labels=labels)
        loss.mean().backward()
        runs.append([loss.detach(), *(p.grad for p in model.parameters())])
    return max((a - b).abs().max().item() for a, b in zip(*runs, strict=True))


def _check_linear_options() -> dict[str, float]:
    """ColumnParallelLinear(gather_output=True) and RowParallelLinear(input_is_parallel=False) equal a full
    linear layer initialised from the same --use-cpu-initialization stream, in output and input gradient."""
    init = lambda weight: torch.nn.init.normal_(weight, std=0.5)  # noqa: E731
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(2))
    errors = {}
    for name, make in (
        ("column_gather_output", lambda: ColumnParallelLinear(8, 6, init_method=init, gather_output=True)),
        (
            "row_input_not_parallel",
            lambda: RowParallelLinear(8, 6, init_method=init, input_is_parallel=False),
        ),
    ):
        with initialization_stream(3, 0):
            full_weight = init(torch.empty(6, 8))
        expected_input = x.clone().requires_grad_()
        expected = F.linear(expected_input, full_weight)
        expected.sum().backward()
        with initialization_stream(3, 0):
            layer = make()
        leaf = x.clone().requires_grad_()
        out = layer(leaf)
        out.sum().backward()
        errors[name] = max(
            (out - expected).abs().max().item(), (leaf.grad - expected_input.grad).abs().max().item()
        )
    return errors


def _kv_cache_error_under_tp() -> float:
    """TP=2 GQA model (2 of 4 query groups per rank): cached decoding equals the full forward's logits."""
    torch.manual_seed(1234)
    model = GPTModel(tiny_llama_config(), VOCAB).eval()
    ids, _ = _batch()
    cache = KVCache(
        2, batch_size=2, max_seq_len=16, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu"
    )
    with torch.no_grad():
        full = model(ids)
        pieces = [model(ids[:, start:end], kv_cache=cache) for start, end in [(0, 6), (6, 7), (7, 16)]]
    return (torch.cat(pieces, dim=1) - full).abs().max().item()


def _check_pipeline_hooks(rank: int) -> float:
    """PP=2: stage 0 (embedding + layer 0) sends hidden states to stage 1 (layer 1 + loss): equals one model."""
    config = tiny_config()
    torch.manual_seed(1234)
    reference = GPTModel(config, VOCAB)
    ids, labels = _batch()
    reference_loss = reference(ids, labels=labels).detach()
    state.initialize_model_parallel(pipeline_model_parallel_size=2)
    first, last = state.is_pipeline_first_stage(), state.is_pipeline_last_stage()
    stage = GPTModel(config, VOCAB, pre_process=first, post_process=last)
    start = stage.decoder.layer_range.start
    weights = {}
    for key, value in reference.state_dict().items():
        if key.startswith("decoder.layers."):
            index, rest = key.removeprefix("decoder.layers.").split(".", 1)
            key = f"decoder.layers.{int(index) - start}.{rest}"
        weights[key] = value
    if last and not first:
        weights["output_layer.weight"] = reference.embedding.word_embeddings.weight.detach()
    stage.load_state_dict({k: v for k, v in weights.items() if k in stage.state_dict()}, strict=True)
    peer = state.get_pipeline_model_parallel_ranks()[1 - state.get_pipeline_model_parallel_rank()]
    error = 0.0
    if first:
        dist.send(stage(ids).detach(), peer)
    else:
        hidden = torch.empty(16, 2, 32)
        dist.recv(hidden, peer)
        stage.set_input_tensor([hidden])
        error = (stage(ids, labels=labels) - reference_loss).abs().max().item()
    state.destroy_model_parallel()
    return error


def _two_rank_worker(rank: int, world_size: int) -> dict:
    state.initialize_model_parallel(tensor_model_parallel_size=2)
    results = {
        "mappings": _check_mappings(state.get_tensor_model_parallel_rank()),
        "cross_entropy": _check_cross_entropy(state.get_tensor_model_parallel_rank()),
        "rng": _check_rng_streams(),
        "kv_cache": _kv_cache_error_under_tp(),
        "linear_options": _check_linear_options(),
        "recompute": {
            f"sp{int(sp)}_{name}": _recompute_error_under_tp(sp, recompute)
            for sp in (False, True)
            for name, recompute in (
                ("selective", dict(recompute_granularity="selective")),
                (
                    "full_uniform",
                    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                ),
            )
        },
    }
    state.destroy_model_parallel()
    results["pipeline"] = _check_pipeline_hooks(rank)
    return results


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    return run_distributed(_two_rank_worker, 2)


@pytest.mark.processes
def test_mappings_forward_and_backward_values(two_rank_results):
    for results in two_rank_results:
        assert results["mappings"] == pytest.approx(dict.fromkeys(results["mappings"], 0.0), abs=1e-6)
        assert len(results["mappings"]) == 8


@pytest.mark.processes
def test_vocab_parallel_cross_entropy_equals_full_softmax(two_rank_results):
    for results in two_rank_results:
        loss_error, grad_error = results["cross_entropy"]
        assert loss_error < 1e-5 and grad_error < 1e-6


@pytest.mark.processes
def test_rng_tracker_splits_streams_across_tp(two_rank_results):
    for results in two_rank_results:
        assert all(results["rng"].values()), results["rng"]


@pytest.mark.processes
def test_recompute_under_tp_and_sp_replays_dropout_exactly(two_rank_results):
    for results in two_rank_results:
        assert max(results["recompute"].values()) < 1e-6, results["recompute"]


@pytest.mark.processes
def test_parallel_linear_gather_and_scatter_options_equal_a_full_linear(two_rank_results):
    for results in two_rank_results:
        assert max(results["linear_options"].values()) < 1e-5, results["linear_options"]


@pytest.mark.processes
def test_kv_cache_decoding_under_tp_equals_full_forward(two_rank_results):
    for results in two_rank_results:
        assert results["kv_cache"] < 1e-5


@pytest.mark.processes
def test_pipeline_hooks_split_the_model_into_stages(two_rank_results):
    assert two_rank_results[1]["pipeline"] < 1e-5


def test_rank_groups_follow_megatron_order():
    groups = state.build_rank_groups(16, tensor_size=2, pipeline_size=4)  # Megatron's docstring example
    assert groups.tensor[:2] == [[0, 1], [2, 3]] and len(groups.tensor) == 8
    assert groups.data[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]] and len(groups.data) == 8
    assert groups.pipeline == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert groups.embedding[0] == [0, 12]
    assert groups.model == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_expert_groups_fold_the_context_ranks_into_expert_data_parallel():
    """Megatron-Core's two generators on 8 ranks, TP 2 x CP 2 x DP 2 and ETP 2 x EP 2 x EDP 2: the dense layers'
    CP ranks are EP ranks for the experts, and the expert grads are reduced over EDP, not DP x CP."""
    groups = state.build_rank_groups(8, tensor_size=2, pipeline_size=1, context_size=2, expert_size=2)
    assert groups.context == [[0, 2], [1, 3], [4, 6], [5, 7]] and groups.data == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    assert groups.data_with_context == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups.tensor_and_context == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups.expert_tensor == groups.tensor and groups.expert_model == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups.expert_data == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups.expert_tensor_and_model == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_sizes_that_do_not_divide_the_world_raise():
    with pytest.raises(ValueError, match="world size 6 is not divisible"):
        state.build_rank_groups(6, tensor_size=4, pipeline_size=1)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2"):
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).data_parallel_size(6)
    assert ParallelConfig(tensor_model_parallel_size=2).data_parallel_size(8) == 4
    assert ParallelConfig(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2)\
        .virtual_pipeline_model_parallel_size(8) == 2  # fmt: skip


def test_uninitialised_state_is_single_process():
    assert state.get_tensor_model_parallel_world_size() == 1 and state.get_data_parallel_rank() == 0
    assert state.is_pipeline_first_stage() and state.is_pipeline_last_stage()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        state.get_tensor_model_parallel_group()


def test_tp_size_must_divide_heads_and_vocab():
    from megatron_train.parallel.layers import divide

    with pytest.raises(ValueError, match="--num-attention-heads .* tensor model parallel size"):
        divide(6, 4, "--num-attention-heads")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cross_entropy_on_half_precision_logits_is_fp32_with_grad_in_logits_dtype(dtype):
    """One rank: low-precision logits give the fp32 loss of their values, and a gradient in their own dtype."""
    torch.manual_seed(0)
    logits = torch.randn(5, 3, 40).to(dtype).requires_grad_()
    target = torch.randint(0, 40, (5, 3))
    loss = vocab_parallel_cross_entropy(logits, target)
    reference_logits = logits.detach().float().requires_grad_()
    reference = F.cross_entropy(reference_logits.view(-1, 40), target.view(-1), reduction="none").view(5, 3)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    loss.sum().backward()
    reference.sum().backward()
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad, reference_logits.grad.to(dtype))
