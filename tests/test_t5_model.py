"""T5Model: equal logits to `transformers.T5ForConditionalGeneration` (T5 v1.0) with copied weights; the
relative position buckets are T5's; encoder padding is never attended; the LM loss is the per-token cross
entropy of the decoder labels, 0 outside them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from megatron_train.models.config import TransformerConfig
from megatron_train.models.hf_t5 import load_hf_t5, transformer_config_from_hf_t5
from megatron_train.models.t5 import T5Model, relative_position_bucket

HF_CONFIG = dict(
    vocab_size=120, d_model=32, d_kv=12, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
    relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
    feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0,
)  # fmt: skip


@pytest.fixture(scope="module")
def hf_t5(tmp_path_factory) -> tuple[transformers.T5ForConditionalGeneration, str]:
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**HF_CONFIG)).eval()
    with torch.no_grad():  # T5's init leaves the bias tables at N(0, small): make positions matter
        for stack in (model.encoder, model.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 1.0)
    directory = str(tmp_path_factory.mktemp("hf-t5"))
    model.save_pretrained(directory)
    return model, directory


def test_hf_t5_v1_0_loads_with_equal_encoder_states_and_logits(hf_t5) -> None:
    hf, directory = hf_t5
    ours, config = load_hf_t5(directory)
    assert (config.num_layers, config.num_decoder_layers, config.kv_channels) == (2, 3, 12)
    torch.manual_seed(1)
    encoder_ids, decoder_ids = torch.randint(1, 120, (3, 30)), torch.randint(1, 120, (3, 11))
    encoder_mask = torch.ones(3, 30, dtype=torch.long)
    encoder_mask[1, 17:] = encoder_mask[2, 5:] = 0
    with torch.no_grad():
        expected = hf(input_ids=encoder_ids, attention_mask=encoder_mask, decoder_input_ids=decoder_ids)
        encoded = ours.encode(encoder_ids, encoder_mask).transpose(0, 1)
        logits = ours(encoder_ids, decoder_ids, encoder_mask)
    real = encoder_mask.bool()
    torch.testing.assert_close(encoded[real], expected.encoder_last_hidden_state[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected.logits, rtol=1e-5, atol=1e-5)
    assert logits.abs().max() > 1.0  # not equal by being near zero


def test_hf_t5_v1_1_gated_mlp_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="feed_forward_proj 'gated-gelu'.*T5 v1.0 checkpoints"):
        transformer_config_from_hf_t5({**HF_CONFIG, "feed_forward_proj": "gated-gelu"})


def test_missing_files_and_tensors_name_what_is_missing(tmp_path, hf_t5) -> None:
    with pytest.raises(FileNotFoundError, match="config.json is missing; pass a Hugging Face T5 checkpoint"):
        load_hf_t5(str(tmp_path))
    transformers.T5Config(**HF_CONFIG).save_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or pytorch_model.bin"):
        load_hf_t5(str(tmp_path))
    weights = {k: v for k, v in hf_t5[0].state_dict().items() if "block.1.layer.2" not in k}
    torch.save(weights, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="lacks 'decoder.block.1.layer.2.layer_norm.weight'"):
        load_hf_t5(str(tmp_path))


def test_relative_position_buckets_are_t5s() -> None:
    relative = torch.arange(-200, 201)[None, :]
    for bidirectional in (True, False):
        expected = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
            relative, bidirectional=bidirectional, num_buckets=32, max_distance=128
        )
        assert torch.equal(relative_position_bucket(relative, bidirectional, 32, 128), expected)
    # Causal: every key after the query shares bucket 0; bidirectional: the two directions use separate halves.
    assert relative_position_bucket(torch.tensor([0, 1, 50]), False, 32, 128).tolist() == [0, 0, 0]
    assert relative_position_bucket(torch.tensor([-1, 1]), True, 32, 128).tolist() == [1, 17]


def tiny_t5(position_embedding_type: str) -> T5Model:
    torch.manual_seed(0)
    config = TransformerConfig(
        encoder_num_layers=2, decoder_num_layers=1, hidden_size=32, num_attention_heads=4, encoder_seq_length=16,
        decoder_seq_length=8, position_embedding_type=position_embedding_type, hidden_dropout=0.0,
        attention_dropout=0.0, true_vocab_size=60,
    )  # fmt: skip
    return T5Model(config, 64).eval()


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "relative"])
def test_encoder_padding_is_never_attended_and_the_decoder_is_causal(position_embedding_type) -> None:
    model = tiny_t5(position_embedding_type)
    encoder_ids, decoder_ids = torch.randint(0, 60, (1, 16)), torch.randint(0, 60, (1, 8))
    mask = (torch.arange(16) < 10).long()[None]
    other_padding = encoder_ids.clone()
    other_padding[0, 10:] = torch.randint(0, 60, (6,))
    other_future = decoder_ids.clone()
    other_future[0, 5:] = torch.randint(0, 60, (3,))
    with torch.no_grad():
        logits = model(encoder_ids, decoder_ids, mask)
        torch.testing.assert_close(model(other_padding, decoder_ids, mask), logits)
        torch.testing.assert_close(model(encoder_ids, other_future, mask)[:, :5], logits[:, :5])
        assert not torch.allclose(model(encoder_ids, decoder_ids)[:, :5], logits[:, :5])  # the mask matters


def test_lm_loss_is_the_cross_entropy_of_the_labels_and_zero_outside_them() -> None:
    model = tiny_t5("relative")
    encoder_ids, decoder_ids = torch.randint(0, 60, (2, 16)), torch.randint(0, 60, (2, 8))
    labels = torch.randint(0, 60, (2, 8))
    labels[1, 6:] = -1
    with torch.no_grad():
        losses = model(encoder_ids, decoder_ids, lm_labels=labels)
        logits = model(encoder_ids, decoder_ids)
    expected = F.cross_entropy(
        logits[:, :, :60].reshape(-1, 60), labels.clamp(min=0).view(-1), reduction="none"
    )
    torch.testing.assert_close(losses, expected.view(2, 8) * (labels >= 0))
    assert torch.isinf(logits[..., 60:]).all() and (losses[1, 6:] == 0).all()


def test_gpt_refuses_relative_positions_and_t5_refuses_rope() -> None:
    from megatron_train.models.gpt import GPTModel

    config = tiny_t5("relative").config
    with pytest.raises(
        ValueError, match="relative is T5's attention bias; GPT takes learned_absolute, rope or none"
    ):
        GPTModel(config, 64)
    with pytest.raises(ValueError, match="T5 takes --position-embedding-type learned_absolute or relative"):
        tiny_t5("rope")
