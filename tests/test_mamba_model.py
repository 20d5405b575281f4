"""The Mamba-2 mixer and MambaModel in one process: the chunked scan against the recurrence written out, documents
restarting the state, generation with the state cache against full recomputation, beam search's reordered state,
the layer pattern's flags, terms and weight decay, the context-parallel exchange's reorder."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_train.arguments import MegatronConfig, parse_args, validate_pipeline_parallel
from megatron_train.data.config import DataConfig
from megatron_train.families.hybrid import HYBRID
from megatron_train.inference.beam_search import BeamSearchParams, beam_search
from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.models.config import TransformerConfig
from megatron_train.models.hybrid import MambaModel
from megatron_train.models.hybrid_pattern import pattern_from_ratios
from megatron_train.models.mamba_context_parallel import shares_by_rank, to_rank_order, to_sequence_order
from megatron_train.models.ssd import ssd_chunk_scan, ssd_step
from megatron_train.optimizer.optimizer import no_weight_decay
from megatron_train.parallel.context_parallel import chunk_indices
from megatron_train.parallel.layers import slice_for_rank
from megatron_train.tokenizer.null import NullTokenizer
from megatron_train.training.entry import check_family_config
from tests.helpers.mamba_reference import random_scan_inputs, sequential_scan

TINY_HYBRID = dict(
    hidden_size=32, num_attention_heads=4, seq_length=64, hybrid_layer_pattern="M*M-", hidden_dropout=0.0,
    attention_dropout=0.0, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
    position_embedding_type="none", normalization="RMSNorm", true_vocab_size=60,
)  # fmt: skip


def tiny_hybrid(**overrides) -> MambaModel:
    torch.manual_seed(0)
    return MambaModel(TransformerConfig(**{**TINY_HYBRID, **overrides}), 64).eval()


@pytest.mark.parametrize(("length", "chunk"), [(37, 8), (64, 16), (5, 16), (50, 7), (33, 32)])
def test_chunked_scan_equals_the_sequential_recurrence(length, chunk) -> None:
    inputs = random_scan_inputs(2, length, heads=4, head_dim=3, groups=2, state=5, seed=length)
    initial = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(1))
    documents = torch.tensor([[0] * (length // 3) + [1] * (length - length // 3), [0] * length])
    for seq_idx in (None, documents):
        y, final = ssd_chunk_scan(
            inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], chunk, D=inputs["D"],
            initial_states=initial, seq_idx=seq_idx, return_final_states=True,
        )  # fmt: skip
        expected, expected_final = sequential_scan(**inputs, initial_state=initial, seq_idx=seq_idx)
        torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(final.double(), expected_final, rtol=0, atol=1e-5)
    state, steps = initial.clone(), []
    for t in range(length):  # the one-step recurrence generation uses
        args = (inputs[k][:, t] for k in ("x", "dt"))
        steps.append(ssd_step(state, *args, inputs["A"], inputs["B"][:, t], inputs["C"][:, t], inputs["D"]))
    expected, expected_final = sequential_scan(**inputs, initial_state=initial)
    torch.testing.assert_close(torch.stack(steps, 1).double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(state.double(), expected_final, rtol=0, atol=1e-5)


def test_the_scan_keeps_an_fp32_state_under_bf16() -> None:
    inputs = {k: v.bfloat16() for k, v in random_scan_inputs(1, 20, 2, 4, 1, 4).items()}
    y, final = ssd_chunk_scan(
        inputs["x"],
        inputs["dt"],
        inputs["A"],
        inputs["B"],
        inputs["C"],
        8,
        D=inputs["D"],
        return_final_states=True,
    )
    assert (y.dtype, final.dtype) == (torch.bfloat16, torch.float32)
    expected, _ = sequential_scan(**inputs)
    torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=2e-2)


def test_documents_restart_the_convolution_and_the_state() -> None:
    model = tiny_hybrid()
    tokens = torch.randint(0, 60, (2, 30), generator=torch.Generator().manual_seed(2))
    labels = tokens.roll(-1, 1)
    documents = torch.tensor([[0] * 11 + [1] * 19] * 2)
    with torch.no_grad():
        packed = model(tokens, labels=labels, document_ids=documents)
        alone = model(tokens[:, 11:], labels=labels[:, 11:])
        first = model(tokens[:, :11], labels=labels[:, :11])
    torch.testing.assert_close(packed[:, 11:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, :11], first, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern", ["MMM", "M*M-", "*-M", "ME*E"])
def test_the_state_cache_gives_the_logits_and_tokens_of_full_recomputation(pattern) -> None:
    model = tiny_hybrid(hybrid_layer_pattern=pattern, num_experts=4 if "E" in pattern else None)
    tokens = torch.randint(0, 60, (3, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        cache = model.allocate_inference_cache(3, 40)
        pieces = [model(tokens[:, :9], kv_cache=cache), model(tokens[:, 9:13], kv_cache=cache)]
        pieces += [model(tokens[:, t : t + 1], kv_cache=cache) for t in range(13, 40)]
    torch.testing.assert_close(torch.cat(pieces, 1)[..., :60], full[..., :60], rtol=1e-5, atol=1e-5)

    tokenizer = NullTokenizer(59)  # ids 0..59, 59 the eod
    prompts = ["1 2 3", "7 8 9 10 11 12 13", "40"]  # per-row prompt lengths, as the server's batches
    params = GenerationParams(tokens_to_generate=12, top_k=1, use_eod_token_for_early_termination=False)
    cached = generate(model, tokenizer, prompts, params)
    recomputed = generate(
        model, tokenizer, prompts, GenerationParams(**{**params.__dict__, "use_kv_cache": False})
    )
    assert cached.tokens == recomputed.tokens
    assert [len(row) for row in cached.tokens] == [15, 19, 13]


def test_beam_search_reorders_the_recurrent_state() -> None:
    """Each hypothesis' score is what a full forward of its tokens gives: a beam continuing from another beam's
    state without its conv and SSM state reordered would score differently."""
    model = tiny_hybrid()
    tokenizer = NullTokenizer(59)
    result = beam_search(model, tokenizer, "3 4 5", BeamSearchParams(beam_width=3, tokens_to_generate=6))
    assert len(result.tokens) == 3
    for tokens, score in zip(result.tokens, result.scores, strict=True):
        row = torch.tensor([tokens])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(row)[0, :-1, :60].float(), -1)
        total = logprobs[torch.arange(len(tokens) - 1), row[0, 1:]][2:].sum().item()
        assert score == pytest.approx(total / (len(tokens) - 3), abs=1e-4)


def test_a_greedy_beam_of_one_is_the_greedy_answer() -> None:
    model, tokenizer = tiny_hybrid(), NullTokenizer(59)
    beam = beam_search(model, tokenizer, "9 8 7", BeamSearchParams(beam_width=1, tokens_to_generate=5))
    greedy = generate(
        model, tokenizer, ["9 8 7"], GenerationParams(tokens_to_generate=5, top_k=1,
                                                      use_eod_token_for_early_termination=False)
    )  # fmt: skip
    assert beam.tokens[0] == greedy.tokens[0][: len(beam.tokens[0])]


def test_pattern_flags_layer_count_and_refusals() -> None:
    base = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--train-iters", "1",
            "--lr", "1e-3", "--micro-batch-size", "1"]  # fmt: skip
    assert parse_args([*base, "--hybrid-layer-pattern", "M-M*|M-"]).model.num_layers == 6
    old = parse_args([*base, "--hybrid-override-pattern", "MM*"]).model
    assert (old.hybrid_layer_pattern, old.num_layers, old.hybrid_override_pattern) == ("MM*", 3, None)
    ratios = parse_args(
        [*base, "--num-layers", "10", "--hybrid-attention-ratio", "0.2", "--hybrid-mlp-ratio", "0.3"]
    )
    assert ratios.model.hybrid_layer_pattern == pattern_from_ratios(10, 0.2, 0.3) == "MM-*M-*MM-"
    moe = parse_args([*base, "--hybrid-layer-pattern", "M*E|E-", "--num-experts", "4"]).model
    assert (moe.num_layers, moe.moe_layer_pattern, moe.moe_layer_freq) == (5, [0, 0, 1, 1, 0], "1")
    refusals = {
        "--num-layers 5 disagrees with --hybrid-layer-pattern 'MM*M', which has 4 layers: drop --num-layers": {
            "num_layers": 5, "hybrid_layer_pattern": "MM*M"},
        "--hybrid-layer-pattern 'MME' has MoE layers (E): they need --num-experts": {"hybrid_layer_pattern": "MME"},
        "symbol 'x' at 1": {"hybrid_layer_pattern": "MxM"},
        "a pipeline segment between | has no layers": {"hybrid_layer_pattern": "MM||M"},
        "--hybrid-override-pattern is the deprecated name of --hybrid-layer-pattern: give one of them": {
            "hybrid_layer_pattern": "MM", "hybrid_override_pattern": "M*"},
    }  # fmt: skip
    for message, settings in refusals.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            TransformerConfig(hidden_size=32, num_attention_heads=4, **settings)


def _hybrid_config(pattern: str, num_experts: int | None = None, **parallel) -> MegatronConfig:
    model = TransformerConfig(**{**TINY_HYBRID, "hybrid_layer_pattern": pattern, "num_experts": num_experts})
    config = MegatronConfig(model=model, data=DataConfig())
    for name, value in parallel.items():
        setattr(config.parallel, name, value)
    return config


def test_the_family_refuses_layouts_it_cannot_split_naming_the_flag() -> None:
    refusals = {
        "--pipeline-model-parallel-size 2: a hybrid model's stages are the segments": ("M*M-", {
            "pipeline_model_parallel_size": 2}),
        "--num-layers-per-virtual-pipeline-stage: a hybrid model's pipeline stages": ("M*|M-", {
            "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1}),
        "--mamba-num-groups (2) is not divisible by the tensor model parallel size (4)": ("M*M-", {
            "tensor_model_parallel_size": 4}),
        "Mamba heads (8) and --mamba-num-groups (2) must divide by --tensor-model-parallel-size x "
        "--context-parallel-size (2 x 2)": ("M*M-", {"tensor_model_parallel_size": 2, "context_parallel_size": 2}),
        "--num-experts 4: a hybrid model's MoE layers are the E layers of --hybrid-layer-pattern, and 'M*M-' has "
        "none": ("M*M-", {"num_experts": 4}),
    }  # fmt: skip
    for message, (pattern, parallel) in refusals.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            check_family_config(HYBRID, _hybrid_config(pattern, **parallel))
    check_family_config(HYBRID, _hybrid_config("M*|M-", pipeline_model_parallel_size=2))
    check_family_config(HYBRID, _hybrid_config("M*M-", context_parallel_size=2))
    uneven = _hybrid_config("M*E|M-", 4, pipeline_model_parallel_size=2)
    validate_pipeline_parallel(uneven, 1)  # segments of 3 and 2 layers: Megatron cuts at |, of any sizes
    uneven.model.num_layers_in_first_pipeline_stage = 1
    with pytest.raises(ValueError, match=re.escape("--num-layers-in-first-pipeline-stage: a hybrid model's")):
        validate_pipeline_parallel(uneven, 1)
    check_family_config(HYBRID, _hybrid_config("M*|ME", 4, pipeline_model_parallel_size=2,
                                               expert_model_parallel_size=2))  # fmt: skip


def test_terms_count_the_model_and_a_scan_per_mamba_layer() -> None:
    config, moe = _hybrid_config("M*M-"), _hybrid_config("M*ME", num_experts=4)
    for each in (config, moe):
        terms = HYBRID.terms(each, 64)
        assert terms.num_parameters() == sum(p.numel() for p in MambaModel(each.model, 64).parameters())
    terms = HYBRID.terms(config, 64)
    assert [(scan.layers, scan.width, scan.state_dim) for scan in terms.scans] == [(2, 64, 8)]
    assert terms.flops_per_sample() > HYBRID.terms(_hybrid_config("*M-"), 64).flops_per_sample()
    # an E layer's FLOPs count its top-2 of 4 experts (the active parameters): two dense MLPs' worth and a router
    dense_mlps = HYBRID.terms(_hybrid_config("M*M--"), 64).flops_per_sample() - terms.flops_per_sample()
    router = 3 * 2 * 64 * 4 * 32  # fwd + bwd, 64 tokens, 4 experts x hidden 32
    assert HYBRID.terms(moe, 64).flops_per_sample() - terms.flops_per_sample() == dense_mlps + router


def test_a_log_d_and_dt_bias_get_no_weight_decay() -> None:
    model = tiny_hybrid()
    exempt = {
        name.rsplit(".", 1)[-1] for name, param in model.named_parameters() if no_weight_decay(name, param)
    }
    assert {"A_log", "D", "dt_bias"} <= exempt
    decayed = {name for name, param in model.named_parameters() if not no_weight_decay(name, param)}
    assert (
        "decoder.layers.0.mixer.in_proj.weight" in decayed
        and "decoder.layers.0.mixer.conv1d.weight" in decayed
    )


@pytest.mark.parametrize("cp", [2, 3])
def test_the_context_parallel_all_to_all_gives_each_rank_its_heads_over_the_sequence_in_order(cp) -> None:
    """The mixer's exchange on CP ranks simulated in one process: each rank's load-balanced chunks (r and
    2 CP - 1 - r) split into per-rank shares of z, x, B, C and dt; rank j receiving share j of every rank (the
    all-to-all, rank order) and reordering holds the whole sequence in order for its heads and groups, as it
    slices the mixer's parameters; the inverse reorder gives back what it received."""
    parts, seq = (4 * cp, 4 * cp, 2 * cp, 2 * cp, cp), 4 * cp
    whole = torch.randn(2, seq, sum(parts))
    shares = [shares_by_rank(whole[:, chunk_indices(seq, cp, rank)], parts, cp) for rank in range(cp)]
    for j in range(cp):
        received = torch.cat([share[:, :, j] for share in shares], dim=1)
        mine = to_sequence_order(received, cp)
        assert torch.equal(mine, slice_for_rank(whole, 2, cp, j, partition_sizes=parts))
        assert torch.equal(to_rank_order(mine, cp), received)
