"""The converter's `hf` loader and saver: HF GPT-2, Llama and Qwen2 folders in and out, and flow -> hf -> flow round
trips."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from megatron_train.checkpointing import load_model_for_inference
from megatron_train.convert import ModelWeights, flow
from megatron_train.convert.weights import trim_vocab
from megatron_train.inference.generation import GenerationParams, generate_tokens
from megatron_train.tokenizer.build import tokenizer_from_config
from megatron_train.tools.checkpoint_util import main
from tests.helpers.convert_models import VOCAB, hf_logits, ids, our_llama, save_word_tokenizer, shard_tensors

transformers = pytest.importorskip("transformers")


def _hf_gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(3)
    return transformers.GPT2LMHeadModel(config).eval()


def _hf_llama(untied: bool, rope_type: str) -> torch.nn.Module:
    rope = {"rope_type": rope_type, "rope_theta": 500000.0}
    if rope_type == "llama3":
        rope |= {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}  # fmt: skip
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=not untied,
        rope_parameters=rope, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(4)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm weight shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape) * 0.1)
    return model


def _hf_mistral() -> torch.nn.Module:
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, sliding_window=None, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(6)
    return transformers.MistralForCausalLM(config).eval()


def _hf_qwen2() -> torch.nn.Module:
    """Qwen2 as released: q/k/v biases, tied embeddings (the small ones), a large rope_theta, GQA."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(8)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts the biases at zero: give them values that show in the logits
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_()
    return model


HF_MODELS = {
    "gpt2": _hf_gpt2,
    "llama_gqa_untied": lambda: _hf_llama(untied=True, rope_type="default"),
    "llama_gqa_tied": lambda: _hf_llama(untied=False, rope_type="default"),
    "llama3_rope_scaling": lambda: _hf_llama(untied=True, rope_type="llama3"),
    "mistral_head_dim_16": _hf_mistral,  # head_dim * heads != hidden size: --kv-channels from config.json
    "qwen2_qkv_bias_tied": _hf_qwen2,
}


def _convert(*argv: str) -> None:
    main(["--model-type", "GPT", *argv])


@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_model_converted_in_gives_transformers_logits_and_back_out_loads_cleanly(name, tmp_path, caplog):
    # GPT-2 has 16 positions; Llama's run far enough that Llama-3.1's rope scaling changes the logits
    hf_model, tokens = HF_MODELS[name](), ids(16 if name == "gpt2" else 1024)
    hf_model.save_pretrained(tmp_path / "hf")
    save_word_tokenizer(str(tmp_path / "hf"))
    if name.startswith("qwen2"):  # released Qwen2 config.json files name the sliding window they leave off
        hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
        (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config | {"sliding_window": 32768}))
    with torch.no_grad():
        expected = hf_model(tokens).logits
    _convert("--loader", "hf", "--saver", "flow", "--load-dir", str(tmp_path / "hf"),
             "--save-dir", str(tmp_path / "flow"))  # fmt: skip
    model, config = load_model_for_inference(str(tmp_path / "flow"), device="cpu")
    assert (model.vocab_size, config.model.true_vocab_size) == (128, VOCAB)
    assert config.tokenizer.tokenizer_type == "HuggingFaceTokenizer"
    assert tokenizer_from_config(config.tokenizer).vocab_size == VOCAB  # the copied tokenizer builds
    with (
        open(f"{tmp_path}/flow/tokenizer/tokenizer.json", "rb") as a,
        open(f"{tmp_path}/hf/tokenizer.json", "rb") as b,
    ):
        assert a.read() == b.read()
    with torch.no_grad():
        logits = model(tokens)
    torch.testing.assert_close(logits[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(logits[..., VOCAB:]).all()  # the padding rows are never predicted

    _convert("--loader", "flow", "--saver", "hf", "--load-dir", str(tmp_path / "flow"),
             "--save-dir", str(tmp_path / "out"))  # fmt: skip
    torch.testing.assert_close(
        hf_logits(str(tmp_path / "out"), tokens, caplog), expected, rtol=1e-5, atol=1e-5
    )
    with open(tmp_path / "out" / "config.json") as handle:
        exported = json.load(handle)
    assert exported["vocab_size"] == VOCAB  # padding rows trimmed on export
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (0, 0)  # carried through our checkpoint
    assert os.path.exists(tmp_path / "out" / "tokenizer.json")


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa_untied", "llama_gqa_tied", "qwen2_qkv_bias_tied"])
def test_hf_model_converted_in_generates_transformers_greedy_tokens(name, tmp_path):
    """The generation engine the server runs, on the converted checkpoint, against `transformers` `generate`."""
    hf_model = HF_MODELS[name]()
    hf_model.save_pretrained(tmp_path / "hf")
    save_word_tokenizer(str(tmp_path / "hf"))
    _convert("--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "flow"))
    model, config = load_model_for_inference(str(tmp_path / "flow"), device="cpu")
    prompts = ids(4)
    hf_model.generation_config.eos_token_id = None  # both generate all 10 tokens
    with torch.no_grad():
        expected = hf_model.generate(prompts, do_sample=False, max_new_tokens=10, pad_token_id=0)
        tokens = torch.cat((prompts, torch.zeros(2, 10, dtype=torch.long)), dim=1)
        params = GenerationParams(tokens_to_generate=10, top_k=1, use_eod_token_for_early_termination=False)
        budgets = torch.tensor([10, 10])
        ours = generate_tokens(
            model, tokenizer_from_config(config.tokenizer), tokens, torch.tensor([4, 4]), params, budgets
        )
    assert torch.equal(ours[0], expected), (ours[0], expected)


@pytest.mark.parametrize(("untied", "qkv_bias"), [(True, False), (False, False), (False, True)])
def test_ours_at_tp2_pp2_converted_out_gives_our_logits_in_sharded_safetensors(
    untied, qkv_bias, tmp_path, caplog
):
    config, model = our_llama(untied, qkv_bias)
    weights = ModelWeights(config, trim_vocab(model.state_dict(), VOCAB))
    flow.save(weights, str(tmp_path / "flow"), target_tp=2, target_pp=2)
    assert sorted(os.listdir(tmp_path / "flow" / "iter_0000001"))[1:] == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001",
    ]  # fmt: skip
    _convert("--loader", "flow", "--saver", "hf", "--load-dir", str(tmp_path / "flow"),
             "--save-dir", str(tmp_path / "hf"), "--max-shard-size", "40000")  # fmt: skip
    with open(tmp_path / "hf" / "model.safetensors.index.json") as handle:
        shards = set(json.load(handle)["weight_map"].values())
    assert len(shards) > 1 and shards <= set(os.listdir(tmp_path / "hf"))
    with open(tmp_path / "hf" / "config.json") as handle:
        architecture = json.load(handle)["architectures"]
    assert architecture == ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"]
    with torch.no_grad():
        ours = model(ids())
    torch.testing.assert_close(hf_logits(str(tmp_path / "hf"), ids(), caplog), ours[..., :VOCAB])


@pytest.mark.parametrize(("tp", "pp", "qkv_bias"), [(1, 1, False), (2, 2, False), (1, 1, True), (2, 2, True)])
def test_flow_to_hf_to_flow_round_trip_is_bitwise(tp, pp, qkv_bias, tmp_path, capsys):
    config, model = our_llama(untied=True, qkv_bias=qkv_bias)
    flow.save(ModelWeights(config, trim_vocab(model.state_dict(), VOCAB)), str(tmp_path / "a"), tp, pp)
    _convert("--saver", "hf", "--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "hf"))
    assert "from_pretrained" in capsys.readouterr().out
    _convert("--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "b"),
             "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp))  # fmt: skip
    printed = capsys.readouterr().out
    assert f"--load {tmp_path / 'b'} --finetune" in printed and "--swiglu" in printed
    assert ("--add-qkv-bias" in printed) == qkv_bias
    assert f"run_text_generation_server --load {tmp_path / 'b'}" in printed
    original, back = (
        shard_tensors(f"{tmp_path}/a/iter_0000001"),
        shard_tensors(f"{tmp_path}/b/iter_0000001"),
    )
    assert original.keys() == back.keys() and len(original) > 4 * tp * pp
    for key, value in original.items():
        assert value == back[key] if key[1] == "metadata" else torch.equal(value, back[key]), key


def test_refusals_name_the_setting(tmp_path, capsys):
    config, model = our_llama(untied=True)
    flow.save(ModelWeights(config, trim_vocab(model.state_dict(), VOCAB)), str(tmp_path / "a"))
    with pytest.raises(SystemExit):
        _convert("--saver", "hf", "--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "hf"),
                 "--target-tensor-parallel-size", "2")  # fmt: skip
    assert "--saver hf writes one unsplit model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _convert("--saver", "megatron", "--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "mg"),
                 "--target-num-layers-per-virtual-pipeline-stage", "1")  # fmt: skip
    assert "lays out flow -> flow resharding only" in capsys.readouterr().err
    os.makedirs(tmp_path / "bert")
    with open(tmp_path / "bert" / "config.json", "w") as handle:
        json.dump({"model_type": "t5"}, handle)
    with pytest.raises(SystemExit):
        _convert("--loader", "hf", "--load-dir", str(tmp_path / "bert"), "--save-dir", str(tmp_path / "b"))
    assert (
        "model_type 't5' is not one the hf loader maps (it maps bert, gpt2, llama, mamba2, mistral, mixtral, qwen2, qwen2_moe)"
        in (capsys.readouterr().err)
    )
    with open(tmp_path / "bert" / "config.json", "w") as handle:  # Llama-2-style linear rope scaling
        json.dump({"model_type": "llama", "num_attention_heads": 4, "rope_scaling": {"type": "linear",
                   "factor": 2.0}}, handle)  # fmt: skip
    with pytest.raises(SystemExit):
        _convert("--loader", "hf", "--load-dir", str(tmp_path / "bert"), "--save-dir", str(tmp_path / "b"))
    assert "rope_type 'linear' is not one this model has (default, llama3)" in capsys.readouterr().err
    with open(tmp_path / "bert" / "config.json", "w") as handle:
        json.dump({"model_type": "llama", "num_attention_heads": 4}, handle)
    with pytest.raises(SystemExit):
        _convert("--loader", "hf", "--load-dir", str(tmp_path / "bert"), "--save-dir", str(tmp_path / "b"))
    assert "config.json lacks 'num_hidden_layers', which a llama config has" in capsys.readouterr().err
    with open(tmp_path / "bert" / "config.json", "w") as handle:
        json.dump({"model_type": "qwen2", "num_attention_heads": 4, "use_sliding_window": True}, handle)
    with pytest.raises(SystemExit):
        _convert("--loader", "hf", "--load-dir", str(tmp_path / "bert"), "--save-dir", str(tmp_path / "b"))
    assert "sliding-window attention is not implemented here" in capsys.readouterr().err


def test_a_truncated_weights_file_or_a_broken_config_is_an_error_naming_the_file(tmp_path, capsys):
    hf_model = next(iter(HF_MODELS.values()))()
    hf_model.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    with open(weights, "r+b") as handle:  # an interrupted download
        handle.truncate(weights.stat().st_size // 2)
    with pytest.raises(SystemExit):
        _convert("--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "a"))
    assert f"{weights} is not a readable safetensors file" in capsys.readouterr().err
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(SystemExit):
        _convert("--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "a"))
    assert f"{tmp_path / 'hf' / 'config.json'}: not a readable JSON file" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_model_shardings_builds_the_model_once_per_config() -> None:
    """A conversion asks for the shardings in its loader and its saver: the meta model is built once."""
    from megatron_train.arguments import MegatronConfig
    from megatron_train.convert import weights as convert_weights
    from megatron_train.data.config import DataConfig
    from megatron_train.families.gpt import GPT
    from megatron_train.models.config import TransformerConfig
    from megatron_train.models.gpt import GPTModel

    builds = []
    counted = dataclasses.replace(
        GPT, model_class=lambda *args, **options: builds.append(args) or GPTModel(*args, **options)
    )
    model = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    config = MegatronConfig(model=model, data=DataConfig())
    first = convert_weights.model_shardings(config, 128, counted)
    assert convert_weights.model_shardings(config, 128, counted) == first and len(builds) == 1
    model.num_layers = 3  # another model is built anew
    assert len(convert_weights.model_shardings(config, 128, counted)) > len(first) and len(builds) == 2
