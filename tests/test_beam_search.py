"""Beam search equals `transformers`' beam search on the same GPT-2 weights."""

from __future__ import annotations

import pytest
import torch

from megatron_train.inference.beam_search import BeamSearchParams, beam_search
from megatron_train.models import GPTModel, TransformerConfig
from megatron_train.models.hf_import import gpt2_state_dict_from_hf
from megatron_train.tokenizer import build_tokenizer
from tests.helpers.tiny import TINY_MODEL

VOCAB = 128
PROMPT = [5, 17, 99, 3]


@pytest.fixture(scope="module")
def pair():
    """HF GPT-2 with random weights and our GPTModel holding the same weights."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, bos_token_id=None,
        eos_token_id=None, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(11)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    config = TransformerConfig.gpt2(**{**TINY_MODEL, "seq_length": 64, "max_position_embeddings": 64})
    ours = GPTModel(config, VOCAB)
    ours.load_state_dict(gpt2_state_dict_from_hf(hf.state_dict(), config), strict=True)
    return ours.eval(), hf


def hf_beams(
    hf, beams: int, new_tokens: int, length_penalty: float, eos: int
) -> tuple[list[list[int]], list[float]]:
    output = hf.generate(
        torch.tensor([PROMPT]), num_beams=beams, num_return_sequences=beams, max_new_tokens=new_tokens,
        length_penalty=length_penalty, early_stopping=False, do_sample=False, eos_token_id=eos, pad_token_id=eos,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    rows = []
    for row in output.sequences.tolist():
        generated = row[len(PROMPT) :]
        end = generated.index(eos) + 1 if eos in generated else len(generated)  # HF pads after eos with eos
        rows.append(PROMPT + generated[:end])
    return rows, output.sequences_scores.tolist()


# A long length penalty favours long beams: there the stop token ends no returned hypothesis.
@pytest.mark.parametrize(
    ("beams", "length_penalty", "stops"), [(2, 1.0, True), (3, 0.0, True), (4, 2.0, False)]
)
def test_beam_search_equals_transformers(pair, beams, length_penalty, stops):
    ours, hf = pair
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB - 1)  # ids 0..126, eod 127
    # A stop token the search meets early: the third token of the unstopped best beam.
    unstopped, _ = hf_beams(hf, beams, 10, length_penalty, eos=tokenizer.eod)
    stop = unstopped[0][len(PROMPT) + 2]
    expected, expected_scores = hf_beams(hf, beams, 10, length_penalty, eos=stop)
    params = BeamSearchParams(
        beam_width=beams, tokens_to_generate=10, length_penalty=length_penalty, stop_token=stop
    )
    result = beam_search(ours, tokenizer, " ".join(map(str, PROMPT)), params)
    assert any(row[-1] == stop for row in result.tokens) == stops
    assert result.tokens == expected
    torch.testing.assert_close(result.scores, expected_scores, rtol=1e-5, atol=1e-5)
    assert result.texts[0] == " ".join(map(str, expected[0]))
