"""Text generation: greedy and seeded sampling, KV cache vs recompute, batching, stop rules, logprobs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from megatron_train.inference import generation
from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.inference.sampling import filter_top_k, filter_top_p, sample
from tests.helpers.generation import CharTokenizer, build_tiny_gpt

# ---------------------------------------------------------------------------------------------------------
# Fixtures shared with test_server.py and test_evaluation.py: a character tokenizer and a tiny GPT.


@pytest.fixture(scope="module")
def tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture(scope="module")
def model():
    return build_tiny_gpt()


# ---------------------------------------------------------------------------------------------------------
# Sampling


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    kept = torch.isfinite(filter_top_k(logits.clone(), 2))
    assert kept.tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(filter_top_p(probs.log(), 0.7)).tolist()
    assert kept == [[True, True, False, False]]  # 0.5 < 0.7, so the 0.3 token joins; then 0.8 > 0.7
    assert torch.isfinite(filter_top_p(probs.log(), 0.1)).tolist() == [[True, False, False, False]]


def test_sample_greedy_and_seeded():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    assert sample(logits, top_k=1).tolist() == logits.argmax(-1).tolist()
    draw = [sample(logits, generator=torch.Generator().manual_seed(7)).tolist() for _ in range(2)]
    assert draw[0] == draw[1]
    filtered = sample(logits, top_k=3, generator=torch.Generator().manual_seed(7))
    assert all(tok in logits[row].topk(3).indices.tolist() for row, tok in enumerate(filtered.tolist()))


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(20000, -1)
    draws = sample(logits, temperature=2.0, generator=torch.Generator().manual_seed(0))
    frequencies = torch.bincount(draws, minlength=3).float() / len(draws)
    assert frequencies.tolist() == pytest.approx(torch.softmax(logits[0] / 2.0, -1).tolist(), abs=0.01)
    nucleus = sample(logits, top_p=0.5, generator=torch.Generator().manual_seed(0))
    assert set(nucleus.tolist()) == {2}  # p(2) = 0.665 alone passes 0.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"top_k": -1}, "top_k"), ({"top_p": 1.5}, "top_p"), ({"temperature": 0.0}, "temperature")],
)
def test_sample_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample(torch.zeros(1, 4), **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Generation


def full_forward_logprobs(model, tokens: list[int], vocab_size: int) -> list[float]:
    """log p(t[i+1] | t[:i+1]) from one forward over the whole sequence, no cache."""
    ids = torch.tensor([tokens])
    logits = model(ids, position_ids=torch.arange(len(tokens)).unsqueeze(0))[..., :vocab_size].float()
    return F.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()


GREEDY = GenerationParams(tokens_to_generate=12, top_k=1, use_eod_token_for_early_termination=False)


def test_greedy_is_deterministic_and_matches_full_forward_argmax(model, tokenizer):
    first = generate(model, tokenizer, ["hello world"], GREEDY)
    assert first.tokens == generate(model, tokenizer, ["hello world"], GREEDY).tokens
    assert len(first.tokens[0]) == len("hello world") + 12
    assert first.finish_reasons == ["length"]
    # Every generated token is the argmax of a full forward over the sequence before it.
    ids = first.tokens[0]
    logits = model(torch.tensor([ids]))[0, :, : tokenizer.vocab_size]
    assert ids[11:] == logits[10:-1].argmax(-1).tolist()
    assert first.texts[0] == tokenizer.detokenize(ids)
    assert first.completions[0] == tokenizer.detokenize(ids[11:])
    assert first.segments[0] == [tokenizer.detokenize([t]) for t in ids]


@pytest.mark.parametrize(
    "params",
    [GREEDY, GenerationParams(tokens_to_generate=12, random_seed=3, top_p=0.9)],
    ids=["greedy", "top_p"],
)
def test_kv_cache_equals_recompute(model, tokenizer, params):
    cached = generate(model, tokenizer, ["ab", "the cat sat"], params)
    recomputed = generate(model, tokenizer, ["ab", "the cat sat"], replace(params, use_kv_cache=False))
    assert cached.tokens == recomputed.tokens


def test_seeded_sampling_is_reproducible(model, tokenizer):
    params = GenerationParams(tokens_to_generate=16, temperature=10.0, random_seed=1234)
    first = generate(model, tokenizer, ["seed me", "x"], params)
    assert first.tokens == generate(model, tokenizer, ["seed me", "x"], params).tokens
    other = generate(model, tokenizer, ["seed me", "x"], replace(params, random_seed=99))
    assert other.tokens != first.tokens


def test_batch_of_unequal_prompts_equals_each_alone(model, tokenizer):
    prompts = ["a", "hello there", "Megatron is"]
    batched = generate(model, tokenizer, prompts, GREEDY)
    for index, prompt in enumerate(prompts):
        alone = generate(model, tokenizer, [prompt], GREEDY)
        assert batched.tokens[index] == alone.tokens[0]
        assert batched.logprobs is None


def test_each_prompt_of_a_batch_keeps_its_own_budget(model, tokenizer):
    prompts, budgets = ["hello", "ab", "xyz w"], [2, 7, 4]
    params = GenerationParams(tokens_to_generate=7, top_k=1, return_output_log_probs=True)
    batch = generate(model, tokenizer, prompts, params, tokens_per_prompt=budgets)
    for row, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        alone = generate(model, tokenizer, [prompt], replace(params, tokens_to_generate=budget))
        assert batch.tokens[row] == alone.tokens[0] and len(alone.tokens[0]) <= len(prompt) + budget
        assert batch.logprobs[row] == pytest.approx(alone.logprobs[0], abs=1e-5)
        assert batch.finish_reasons[row] == alone.finish_reasons[0]
    with pytest.raises(ValueError, match="tokens_per_prompt needs one count from 1 to tokens_to_generate=7"):
        generate(model, tokenizer, prompts, params, tokens_per_prompt=[2, 8, 1])


def test_logprobs_equal_log_softmax_of_a_full_forward(model, tokenizer):
    params = GenerationParams(tokens_to_generate=8, top_k=1, return_output_log_probs=True)
    out = generate(model, tokenizer, ["short", "a longer prompt"], params)
    for row in range(2):
        expected = full_forward_logprobs(model, out.tokens[row], tokenizer.vocab_size)
        assert len(out.logprobs[row]) == len(out.tokens[row]) - 1
        assert out.logprobs[row] == pytest.approx(expected, abs=1e-5)


def test_tokens_to_generate_zero_scores_the_prompt(model, tokenizer):
    params = GenerationParams(tokens_to_generate=0, return_output_log_probs=True)
    out = generate(model, tokenizer, ["score this", "and this one"], params)
    assert out.tokens[1] == tokenizer.tokenize("and this one")
    for row in range(2):
        expected = full_forward_logprobs(model, out.tokens[row], tokenizer.vocab_size)
        assert out.logprobs[row] == pytest.approx(expected, abs=1e-5)


def forced_model(model, forced: dict[int, int]):
    """Wrap `model` so that the logits at position p pick token forced[p] (the token at p + 1)."""

    class Forced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model
            self.config = model.config

        def forward(self, input_ids, position_ids=None, labels=None, kv_cache=None):
            logits = self.inner(input_ids, position_ids=position_ids, kv_cache=kv_cache).clone()
            for col, pos in enumerate(position_ids[0].tolist()):
                if pos in forced:
                    logits[:, col, forced[pos]] = 1e4
            return logits

    return Forced()


def test_stop_on_eod_eol_double_eol_and_stop_strings(model, tokenizer):
    # prompt "ab" (positions 0, 1); the model is forced to emit "x", "\n", "y", "\n", "\n", eod, "z".
    script = ["x", "\n", "y", "\n", "\n", "<eod>", "z"]
    forced = forced_model(model, {pos: tokenizer.vocab[s] for pos, s in enumerate(script, start=1)})

    def run(**kwargs) -> tuple[str, str]:
        out = generate(forced, tokenizer, ["ab"], GenerationParams(tokens_to_generate=7, top_k=1, **kwargs))
        return out.completions[0], out.finish_reasons[0]

    assert run() == ("x\ny\n\n", "stop")  # eod ends the row; the completion leaves it out
    assert run(use_eod_token_for_early_termination=False) == ("x\ny\n\n<eod>z", "length")
    assert run(stop_on_eol=True) == ("x\n", "stop")
    assert run(stop_on_double_eol=True) == ("x\ny\n\n", "stop")
    assert run(stop_strings=("y\n",)) == ("x\n", "stop")
    out = generate(
        forced, tokenizer, ["ab"], GenerationParams(tokens_to_generate=7, top_k=1, stop_on_eol=True)
    )
    assert out.texts == ["abx\n"] and out.tokens[0][-1] == tokenizer.vocab["\n"]


def test_stop_strings_end_each_row_alone(model, tokenizer):
    free = generate(model, tokenizer, ["ab", "cd"], GREEDY)
    stop = free.completions[0][2:4]
    out = generate(model, tokenizer, ["ab", "cd"], replace(GREEDY, stop_strings=(stop,)))
    assert out.completions[0] == free.completions[0][: free.completions[0].find(stop)]
    assert out.finish_reasons[0] == "stop"
    if stop not in free.completions[1]:
        assert out.tokens[1] == free.tokens[1] and out.finish_reasons[1] == "length"


def test_prevent_newline_after_colon(model, tokenizer):
    forced = forced_model(model, {2: tokenizer.vocab["\n"]})
    params = GenerationParams(tokens_to_generate=2, top_k=1, use_eod_token_for_early_termination=False)
    assert generate(forced, tokenizer, ["ab:"], params).tokens[0][3] == tokenizer.vocab["\n"]
    guarded = replace(params, prevent_newline_after_colon=True)
    assert generate(forced, tokenizer, ["ab:"], guarded).tokens[0][3] != tokenizer.vocab["\n"]


def test_add_bos_and_empty_prompts(model, tokenizer):
    with pytest.raises(ValueError, match="add_BOS"):
        generate(model, tokenizer, [""], GREEDY)
    out = generate(model, tokenizer, [""], replace(GREEDY, add_BOS=True))
    assert out.tokens[0][0] == tokenizer.eod and out.prompt_lengths == [1]


def test_max_total_length_caps_every_row(model, tokenizer):
    params = replace(GREEDY, tokens_to_generate=10, max_total_length=8)
    out = generate(model, tokenizer, ["ab", "hello"], params)
    free = generate(model, tokenizer, ["ab", "hello"], GREEDY)
    assert [len(ids) for ids in out.tokens] == [8, 8] and out.finish_reasons == ["length", "length"]
    assert out.tokens == [ids[:8] for ids in free.tokens]
    with pytest.raises(
        ValueError, match="prompt 1 has 5 tokens, no room to generate within max_total_length=5"
    ):
        generate(model, tokenizer, ["ab", "hello"], replace(params, max_total_length=5))


def test_too_long_request_is_refused(model, tokenizer):
    with pytest.raises(ValueError, match="longer than allowed"):
        generate(model, tokenizer, ["x" * 60], GenerationParams(tokens_to_generate=5))
    with pytest.raises(ValueError, match="65 tokens > 64"):
        generate(
            model, tokenizer, ["x" * 65], GenerationParams(tokens_to_generate=0, return_output_log_probs=True)
        )


def test_padded_vocab_is_never_sampled(model, tokenizer):
    # Push all the probability into the padding ids: generation must still stay inside the real vocabulary.
    class PadHeavy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, input_ids, position_ids=None, labels=None, kv_cache=None):
            logits = self.inner(input_ids, position_ids=position_ids, kv_cache=kv_cache).clone()
            logits[..., tokenizer.vocab_size :] = 1e4
            return logits

    out = generate(PadHeavy(), tokenizer, ["abc"], GenerationParams(tokens_to_generate=10, random_seed=0))
    assert max(out.tokens[0]) < tokenizer.vocab_size


def test_model_mode_is_restored(tokenizer):
    model = build_tiny_gpt().train()
    generate(model, tokenizer, ["abc"], GREEDY)
    assert model.training


def _tensor_parallel_worker(rank: int, world_size: int) -> dict[str, list[list[int]]]:
    """Greedy tokens of a learned-absolute GPT and a GQA + RoPE Llama, at TP=1 and at TP=world_size."""
    from megatron_train.models.gpt import GPTModel
    from megatron_train.parallel import state
    from tests.helpers.tiny import tiny_config, tiny_llama_config

    shape = dict(num_attention_heads=4, seq_length=32, init_method_std=0.2)
    configs = {"gpt": tiny_config(**shape), "llama": tiny_llama_config(**shape, num_query_groups=2)}
    results = {}
    for tp in (1, world_size):
        if tp > 1:
            state.initialize_model_parallel(tensor_model_parallel_size=tp)
        for name, config in configs.items():
            # init_seed (--use-cpu-initialization): the same full weights at every TP size
            model = GPTModel(config, 128, init_seed=7).eval()
            out = generate(model, CharTokenizer(), ["hello", "a b"], GREEDY)
            results[f"{name} tp{tp}"] = out.tokens
    return results


@pytest.mark.processes
def test_tensor_parallel_generation_equals_single_process():
    from tests.helpers.distributed import run_distributed

    for ranks in run_distributed(_tensor_parallel_worker, 2):
        assert ranks["gpt tp2"] == ranks["gpt tp1"]
        assert ranks["llama tp2"] == ranks["llama tp1"]


def test_gpt2_newline_ids_are_megatrons():
    """Megatron hard-codes GPT-2's "\\n" = 198 and "\\n\\n" = 628 for stop_on_eol; we derive them."""
    from pathlib import Path

    from megatron_train.tokenizer import build_tokenizer

    vocab = Path(__file__).resolve().parents[2] / "shared" / "vocab"
    if not (vocab / "gpt2-vocab.json").exists():
        pytest.skip("../shared/vocab (the real GPT-2 vocabulary) is absent")
    gpt2 = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=str(vocab / "gpt2-vocab.json"),
        merge_file=str(vocab / "gpt2-merges.txt"),
    )
    rules = generation._StopRules(gpt2, GenerationParams(stop_on_eol=True))
    assert (rules.eol, rules.double_eol, rules.termination_id) == (198, 628, 50256)
