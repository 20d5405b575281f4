"""`checkpoint_util --model-type BERT`: Hugging Face BertForPreTraining / BertForMaskedLM in and out with equal
logits, and bitwise round trips through the hf, megatron and torch_dist formats."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import load_model_for_inference
from megatron_train.convert import ModelWeights, flow
from megatron_train.convert.weights import trim_vocab
from megatron_train.data.config import DataConfig
from megatron_train.families.bert import BERT
from megatron_train.models.bert import BertModel
from megatron_train.models.config import TransformerConfig
from megatron_train.models.transformer import unpack_qkv
from megatron_train.tools.checkpoint_util import main
from tests.helpers.convert_models import VOCAB, shard_tensors

transformers = pytest.importorskip("transformers")
HF_CLASSES = {"pretraining": transformers.BertForPreTraining, "masked_lm": transformers.BertForMaskedLM}


def _convert(*argv: str) -> None:
    main(["--model-type", "BERT", *argv])


def _inputs(token_types: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=generator)
    attention_mask = torch.ones(2, 16, dtype=torch.long)
    attention_mask[1, 11:] = 0
    token_type_ids = torch.zeros(2, 16, dtype=torch.long)
    if token_types:
        token_type_ids[:, 8:] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}


def _hf_bert(kind: str) -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(5)
    return HF_CLASSES[kind](config).eval()


def _loads_cleanly(cls: type, folder: str, caplog) -> torch.nn.Module:
    caplog.clear()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(caplog.handler)
    try:
        model, info = cls.from_pretrained(folder, output_loading_info=True)
    finally:
        hf_logger.removeHandler(caplog.handler)
    assert {key: value for key, value in info.items() if value} == {}, info
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    return model.eval()


@pytest.mark.parametrize("kind", HF_CLASSES)
def test_hf_bert_converted_in_gives_transformers_logits_and_back_out_loads_cleanly(kind, tmp_path, caplog):
    hf_model, binary = _hf_bert(kind), kind == "pretraining"
    hf_model.save_pretrained(tmp_path / "hf")
    inputs = _inputs(token_types=binary)  # a masked LM is fed token type 0
    with torch.no_grad():
        expected = hf_model(**inputs)
    expected_logits = expected.prediction_logits if binary else expected.logits
    _convert("--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "flow"))
    model, config = load_model_for_inference(str(tmp_path / "flow"), device="cpu")
    assert config.model.post_ln and config.model.bert_binary_head == binary
    with torch.no_grad():
        logits, binary_logits = model(*inputs.values())
    torch.testing.assert_close(logits[..., :VOCAB], expected_logits, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(logits[..., VOCAB:]).all()
    if binary:
        torch.testing.assert_close(binary_logits, expected.seq_relationship_logits, rtol=1e-5, atol=1e-5)

    _convert("--loader", "flow", "--saver", "hf", "--load-dir", str(tmp_path / "flow"),
             "--save-dir", str(tmp_path / "out"))  # fmt: skip
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == [HF_CLASSES[kind].__name__] and exported["vocab_size"] == VOCAB
    with torch.no_grad():
        back = _loads_cleanly(HF_CLASSES[kind], str(tmp_path / "out"), caplog)(**inputs)
    torch.testing.assert_close(back.prediction_logits if binary else back.logits, expected_logits)
    if binary:
        torch.testing.assert_close(back.seq_relationship_logits, expected.seq_relationship_logits)


def _our_bert(post_ln: bool, bias_gelu_fusion: bool = False) -> tuple[MegatronConfig, torch.nn.Module]:
    """HF BERT has one GELU for the MLP and the head: without Megatron's bias-GELU fusion (tanh in the MLP only)."""
    model_config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, true_vocab_size=VOCAB, post_ln=post_ln,
        hidden_dropout=0.0, attention_dropout=0.0, bias_gelu_fusion=bias_gelu_fusion,
    )  # fmt: skip
    torch.manual_seed(9)
    return MegatronConfig(model=model_config, data=DataConfig()), BertModel(model_config, 128)


@pytest.mark.parametrize(
    ("saver", "post_ln", "tp", "pp"),
    [("hf", True, 1, 1), ("hf", True, 2, 2), ("megatron", False, 2, 2), ("torch_dist", False, 2, 2)],
)
def test_flow_to_format_to_flow_round_trip_is_bitwise(saver, post_ln, tp, pp, tmp_path, capsys):
    config, model = _our_bert(post_ln)
    weights = ModelWeights(config, trim_vocab(model.state_dict(), VOCAB), family=BERT)
    flow.save(weights, str(tmp_path / "a"), tp, pp)
    target = (
        []
        if saver == "hf"
        else ["--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp)]
    )
    _convert(
        "--saver", saver, "--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "mid"), *target
    )
    _convert("--loader", saver, "--load-dir", str(tmp_path / "mid"), "--save-dir", str(tmp_path / "b"),
             "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp))  # fmt: skip
    assert "pretrain_bert" in capsys.readouterr().out
    original, back = shard_tensors(f"{tmp_path}/a/iter_0000001"), shard_tensors(f"{tmp_path}/b/iter_0000001")
    assert original.keys() == back.keys() and len(original) > 4 * tp * pp
    assert any("binary_head.weight" in key[1] for key in original)
    for key, value in original.items():
        assert value == back[key] if key[1] == "metadata" else torch.equal(value, back[key]), key


def test_model_type_must_match_the_source_and_pre_ln_bert_is_refused_by_hf(tmp_path, capsys):
    config, model = _our_bert(post_ln=False)
    flow.save(ModelWeights(config, trim_vocab(model.state_dict(), VOCAB), family=BERT), str(tmp_path / "a"))
    with pytest.raises(SystemExit):
        main(
            [
                "--model-type",
                "GPT",
                "--saver",
                "hf",
                "--load-dir",
                str(tmp_path / "a"),
                "--save-dir",
                str(tmp_path / "o"),
            ]
        )
    error = capsys.readouterr().err
    assert "--model-type GPT, but" in error and "holds a BERT model: pass --model-type BERT" in error
    with pytest.raises(SystemExit):
        _convert("--saver", "hf", "--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "o"))
    assert "Hugging Face BERT is post-LN (train with --post-ln)" in capsys.readouterr().err
    config, model = _our_bert(post_ln=True, bias_gelu_fusion=True)  # Megatron's default: tanh GELU in the MLP
    flow.save(
        ModelWeights(config, trim_vocab(model.state_dict(), VOCAB), family=BERT),
        str(tmp_path / "fused"),
    )
    with pytest.raises(SystemExit):
        _convert("--saver", "hf", "--load-dir", str(tmp_path / "fused"), "--save-dir", str(tmp_path / "o"))
    assert "train with --no-bias-gelu-fusion (exact in both) or --openai-gelu" in capsys.readouterr().err


def test_released_bert_345m_layout_with_language_model_names_loads(tmp_path):
    """Megatron-LM's older BERT (`language_model.*`, `lm_head.layernorm`, `lm_head.bias`; QKV as [3, heads, d]),
    trained with Megatron's default bias-GELU fusion (its args say nothing else)."""
    config, model = _our_bert(post_ln=False, bias_gelu_fusion=True)
    model.eval()
    state = model.state_dict()
    names = {"input_layernorm": "input_layernorm", "self_attention.linear_proj": "attention.dense",
             "pre_mlp_layernorm": "post_attention_layernorm", "mlp.linear_fc1": "mlp.dense_h_to_4h",
             "mlp.linear_fc2": "mlp.dense_4h_to_h"}  # fmt: skip
    encoder = {}
    for i in range(4):
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                encoder[f"layers.{i}.{theirs}.{kind}"] = state[f"encoder.layers.{i}.{ours}.{kind}"]
        for kind in ("weight", "bias"):
            qkv = state[f"encoder.layers.{i}.self_attention.linear_qkv.{kind}"]
            encoder[f"layers.{i}.attention.query_key_value.{kind}"] = torch.cat(unpack_qkv(qkv, 4, 4))
    for kind in ("weight", "bias"):
        encoder[f"final_layernorm.{kind}"] = state[f"encoder.final_layernorm.{kind}"]

    def pair(prefix: str) -> dict[str, torch.Tensor]:
        return {kind: state[f"{prefix}.{kind}"] for kind in ("weight", "bias")}

    saved = {
        "language_model": {
            "embedding": {name: {"weight": state[f"embedding.{name}.weight"]}
                          for name in ("word_embeddings", "position_embeddings", "tokentype_embeddings")},
            "encoder": encoder,
            "pooler": {"dense": pair("pooler.dense")},
        },
        "lm_head": {"dense": pair("lm_head.dense"), "layernorm": pair("lm_head.layer_norm"),
                    "bias": state["output_layer.bias"]},
        "binary_head": pair("binary_head"),
    }  # fmt: skip
    args = argparse.Namespace(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                              max_position_embeddings=16, padded_vocab_size=128, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1, bert_binary_head=True, hidden_dropout=0.0,
                              attention_dropout=0.0)  # fmt: skip
    (tmp_path / "mg" / "release" / "mp_rank_00").mkdir(parents=True)
    torch.save(
        {"args": args, "model": saved}, tmp_path / "mg" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    )
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("release")
    _convert("--loader", "megatron", "--load-dir", str(tmp_path / "mg"), "--save-dir", str(tmp_path / "flow"),
             "--true-vocab-size", str(VOCAB))  # fmt: skip
    converted, _ = load_model_for_inference(str(tmp_path / "flow"), device="cpu")
    inputs = _inputs(token_types=True)
    with torch.no_grad():
        for ours, expected in zip(converted(*inputs.values()), model(*inputs.values()), strict=True):
            torch.testing.assert_close(ours, expected, rtol=0, atol=0)
