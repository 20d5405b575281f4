"""The hybrid family through the converter: a random `Mamba2ForCausalLM` converted in gives `transformers`' logits
and, served, its greedy tokens; converted out it loads with equal logits; a Megatron-LM legacy checkpoint in the
layout of NVIDIA's released hybrid models (TransformerEngine's fused norms, TP=2) loads with its model's logits."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

import pytest
import torch
from fastapi.testclient import TestClient

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import load_model_for_inference
from megatron_train.checkpointing.layout import split_tp_shard
from megatron_train.convert.megatron import CHECKPOINT_FILE, expert_linear_sharding, experts_to_linears
from megatron_train.convert.weights import model_shardings
from megatron_train.data.config import DataConfig
from megatron_train.families.hybrid import HYBRID
from megatron_train.inference.checkpoint import load_for_inference
from megatron_train.inference.server import ServerLimits, create_app
from megatron_train.models.config import TransformerConfig
from megatron_train.models.hybrid import MambaModel
from megatron_train.tools import run_text_generation_server as server_tool
from megatron_train.tools.checkpoint_util import main as checkpoint_util
from megatron_train.tools.run_hybrid_text_generation_server import hybrid_argv
from tests.helpers.convert_models import VOCAB, hf_logits, ids, save_word_tokenizer

transformers = pytest.importorskip("transformers")


def _hf_mamba2(tied: bool) -> torch.nn.Module:
    config = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, num_heads=8, head_dim=8, n_groups=2,
        expand=2, chunk_size=16, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(5)
    model = transformers.Mamba2ForCausalLM(config).eval()
    with torch.no_grad():  # per-head parameters and norms away from their init, so a swap shows in the logits
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", ".dt_bias")):
                param.add_(torch.randn(param.shape) * 0.3)
    return model


def _convert(*argv: str) -> None:
    checkpoint_util(["--model-type", "HYBRID", *argv])


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def converted(request, tmp_path_factory):
    """(HF model, its folder, our converted run directory)."""
    tmp = tmp_path_factory.mktemp("mamba2")
    hf_model = _hf_mamba2(tied=request.param)
    hf_model.save_pretrained(tmp / "hf")
    save_word_tokenizer(str(tmp / "hf"))
    (tmp / "hf" / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "w0"})
    )  # the eod the server stops at
    _convert(
        "--loader", "hf", "--saver", "flow", "--load-dir", str(tmp / "hf"), "--save-dir", str(tmp / "flow")
    )
    return hf_model, tmp


def test_mamba2_converted_in_gives_transformers_logits_and_converted_out_loads_equal(converted, caplog):
    hf_model, tmp = converted
    tokens = ids(40)
    with torch.no_grad():
        expected = hf_model(tokens).logits
    model, config = load_model_for_inference(str(tmp / "flow"), device="cpu")
    assert isinstance(model, MambaModel) and (config.model.hybrid_layer_pattern, config.model.num_layers) == (None, 2)
    assert config.tokenizer.tokenizer_type == "HuggingFaceTokenizer"
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
    _convert(
        "--loader", "flow", "--saver", "hf", "--load-dir", str(tmp / "flow"), "--save-dir", str(tmp / "out")
    )
    torch.testing.assert_close(hf_logits(str(tmp / "out"), tokens, caplog), expected, rtol=1e-5, atol=1e-5)
    exported = json.loads((tmp / "out" / "config.json").read_text())
    assert (exported["model_type"], exported["vocab_size"], exported["n_groups"]) == ("mamba2", VOCAB, 2)
    assert (tmp / "out" / "tokenizer.json").read_bytes() == (tmp / "hf" / "tokenizer.json").read_bytes()


def test_megatron_core_torch_dist_is_refused_naming_what_it_lacks(converted, capsys):
    _, tmp = converted
    with pytest.raises(SystemExit):
        _convert("--loader", "flow", "--saver", "torch_dist", "--load-dir", str(tmp / "flow"),
                 "--save-dir", str(tmp / "dist"))  # fmt: skip
    assert "--saver torch_dist: the hybrid family: Megatron-Core saves Mamba mixers' in-projection" in (
        capsys.readouterr().err
    )


def test_the_served_conversion_answers_transformers_greedy_tokens(converted):
    hf_model, tmp = converted
    args = server_tool.build_parser([]).parse_args(["--load", str(tmp / "flow")])
    model, tokenizer, _ = load_for_inference(args)
    client = TestClient(
        create_app(model, tokenizer, ServerLimits(max_batch_size=2, max_tokens_to_generate=8))
    )
    prompts = [
        [5, 9, 2],
        [7, 7, 31, 12, 3, 40],
    ]  # one request, two prompt lengths: the batch's per-row lengths
    answer = client.put(
        "/api",
        json={
            "prompts": [" ".join(f"w{i}" for i in p) for p in prompts],
            "tokens_to_generate": 8,
            "top_k": 1,
        },
    )
    assert answer.status_code == 200, answer.text
    hf_model.generation_config.eos_token_id = None  # both generate all 8 tokens
    for prompt, text in zip(prompts, answer.json()["text"], strict=True):
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=8, pad_token_id=0
            )
        assert text == tokenizer.detokenize(expected[0].tolist())
    beams = client.put("/api", json={"prompts": ["w5 w9"], "tokens_to_generate": 3, "beam_width": 2})
    assert beams.status_code == 200 and len(beams.json()["text"]) == 2  # beam search reorders the state


def test_a_hybrid_with_attention_or_positions_is_refused_by_the_hf_saver():
    base = dict(hidden_size=32, num_attention_heads=4, seq_length=16, mamba_head_dim=8, mamba_num_groups=2,
                normalization="RMSNorm", position_embedding_type="none")  # fmt: skip
    for settings, message in (
        ({"hybrid_layer_pattern": "M*M"}, "Mamba2ForCausalLM has Mamba layers only"),
        ({"hybrid_layer_pattern": "MEM", "num_experts": 4}, "Mamba2ForCausalLM has Mamba layers only"),
        ({"hybrid_layer_pattern": "MM", "position_embedding_type": "rope"}, "has no position embeddings"),
    ):
        with pytest.raises(ValueError, match=message):
            HYBRID.hf.export(TransformerConfig(**{**base, **settings}), {})


def _fused_names(name: str) -> str:
    """Our name -> Megatron-Core's with TransformerEngine's spec (the norms fused into the next linear layer;
    conv1d_weight, the newer parameter name, on layer 0)."""
    for ours, theirs in (
        ("norm.weight", "mixer.in_proj.layer_norm_weight"),
        ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ):
        if name.endswith(f".{ours}") and ".mixer.norm." not in name and name.startswith("decoder.layers."):
            return name.removesuffix(ours) + theirs
    return name.replace("layers.0.mixer.conv1d.weight", "layers.0.mixer.conv1d_weight")


def test_a_megatron_legacy_hybrid_checkpoint_in_the_released_layout_loads(tmp_path):
    """Megatron's hybrid_conversion.py layout: mp_rank_TT/model_optim_rng.pt per TP rank, the in-projection's and
    convolution's parts each split over TP, args naming the pattern by its old flag; the MoE layer (E) as
    Megatron-Core's hybrid MoE layer names it: an unfused pre_mlp_layernorm, mlp.router and one Linear per expert
    (mlp.experts.local_experts.<j>), each split over TP."""
    model_config = TransformerConfig(
        hidden_size=32, num_attention_heads=4, seq_length=16, hybrid_layer_pattern="M*E-", mamba_head_dim=8,
        mamba_num_groups=2, mamba_state_dim=8, normalization="RMSNorm", position_embedding_type="none",
        add_bias_linear=False, untie_embeddings_and_output_weights=True, true_vocab_size=VOCAB, num_experts=4,
    )  # fmt: skip
    torch.manual_seed(2)
    reference = MambaModel(model_config, 128).eval()
    args = argparse.Namespace(
        **{k: v for k, v in dataclasses.asdict(model_config).items() if not k.startswith("hybrid_")},
        hybrid_override_pattern="M*E-", tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
        padded_vocab_size=128, tokenizer_type="NullTokenizer", vocab_size=VOCAB - 1, params_dtype=torch.float32,
    )  # fmt: skip
    shardings = model_shardings(MegatronConfig(model=model_config, data=DataConfig()), 128, HYBRID)
    state = reference.state_dict()
    for tp_rank in range(2):
        shard = {}
        for name, tensor in state.items():
            expert = re.fullmatch(r"(.*\.mlp\.experts\.)weight([12])", name)
            if expert is None:  # the E layer's norm is TransformerEngine's TENorm, not fused into its experts
                saved = name if name.startswith("decoder.layers.2.") else _fused_names(name)
                shard[saved] = split_tp_shard(tensor, shardings[name], 2, tp_rank)
                continue
            linear = f"linear_fc{expert[2]}"
            sharding = expert_linear_sharding(linear, model_config)
            for j, weight in enumerate(experts_to_linears(tensor)):
                key = f"{expert[1]}local_experts.{j}.{linear}.weight"
                shard[key] = split_tp_shard(weight, sharding, 2, tp_rank)
        path = tmp_path / "release" / f"mp_rank_{tp_rank:02d}" / CHECKPOINT_FILE
        os.makedirs(path.parent)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0, "model": shard}, path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    _convert("--loader", "megatron", "--saver", "flow", "--load-dir", str(tmp_path),
             "--save-dir", str(tmp_path / "flow"))  # fmt: skip
    model, _ = load_model_for_inference(str(tmp_path / "flow"), device="cpu")
    tokens = ids(16)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-5, atol=1e-5)
    # served where it lies: --load detects Megatron's format, Megatron's server name reads it as a hybrid model
    argv = hybrid_argv(["--load", str(tmp_path), "--hybrid-layer-pattern", "M*E-", "--bf16", "--seed", "42"])
    served, _, _ = load_for_inference(server_tool.build_parser(argv).parse_args(argv))
    with torch.no_grad():
        torch.testing.assert_close(served(tokens), reference(tokens), rtol=1e-5, atol=1e-5)
