"""MoE checkpoints through the converter: random Mixtral and Qwen2-MoE models made with `transformers` converted in
give its logits and, served, its greedy tokens; converted out they load in `transformers` with the same logits;
Megatron-LM's legacy MoE files (SequentialMLP's `local_experts.<j>` over EP ranks, TransformerEngine's grouped
`weight<j>`, the GroupedMLP's `weight1`) read to the same model."""

from __future__ import annotations

import json
import os

import pytest
import torch
from fastapi.testclient import TestClient

from megatron_train.checkpointing import load_model_for_inference
from megatron_train.convert import ModelWeights, megatron
from megatron_train.convert.weights import trim_vocab
from megatron_train.families.gpt import GPT
from megatron_train.inference.server import ServerLimits, create_app
from megatron_train.tokenizer.build import tokenizer_from_config
from megatron_train.tokenizer.chat import serving_chat_format
from megatron_train.tools.checkpoint_util import main
from tests.helpers.convert_models import (
    LLAMA2_CHAT_TEMPLATE,
    VOCAB,
    hf_logits,
    ids,
    our_llama,
    save_chat_tokenizer,
)

transformers = pytest.importorskip("transformers")
LIMITS = ServerLimits(
    max_batch_size=4, max_tokens_to_generate=16, max_tokens_to_oom=400, max_request_bytes=4000
)
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    bos_token_id=1, eos_token_id=2, num_experts_per_tok=2,
)  # fmt: skip


def _hf_mixtral() -> torch.nn.Module:
    config = transformers.MixtralConfig(
        **COMMON, intermediate_size=16, num_hidden_layers=2, num_local_experts=4, rope_parameters={
            "rope_type": "default", "rope_theta": 1e6}, sliding_window=None,
    )  # fmt: skip
    torch.manual_seed(11)
    return transformers.MixtralForCausalLM(config).eval()


def _hf_qwen2_moe(norm_topk_prob: bool) -> torch.nn.Module:
    """Layer 1 dense (mlp_only_layers), a gated shared expert, q/k/v biases given values."""
    config = transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_hidden_layers=3, num_experts=4, mlp_only_layers=[1], norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    torch.manual_seed(12)
    model = transformers.Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_()
    return model


HF_MODELS = {
    "mixtral": _hf_mixtral,
    "qwen2_moe": lambda: _hf_qwen2_moe(norm_topk_prob=False),
    "qwen2_moe_norm_topk_prob": lambda: _hf_qwen2_moe(norm_topk_prob=True),
}


def _convert(*argv: str) -> None:
    main(["--model-type", "GPT", *argv])


@pytest.fixture(scope="module", params=list(HF_MODELS))
def converted(request, tmp_path_factory):
    """(name, the HF model, the folder it was saved to with a chat tokenizer, our checkpoint converted from it)."""
    tmp = tmp_path_factory.mktemp(request.param)
    hf_model = HF_MODELS[request.param]()
    hf_model.save_pretrained(tmp / "hf")
    save_chat_tokenizer(str(tmp / "hf"), LLAMA2_CHAT_TEMPLATE)
    _convert("--loader", "hf", "--load-dir", str(tmp / "hf"), "--save-dir", str(tmp / "flow"))
    return request.param, hf_model, tmp


def test_hf_moe_converted_in_gives_transformers_logits_and_back_out_loads_with_them(converted, caplog):
    name, hf_model, tmp = converted
    tokens = ids(16)
    with torch.no_grad():
        expected = hf_model(tokens).logits
    model, config = load_model_for_inference(str(tmp / "flow"), device="cpu")
    assert config.model.num_experts == 4 and config.model.moe_router_topk == 2
    assert config.model.moe_router_pre_softmax == (name == "qwen2_moe")  # Qwen2-MoE without norm_topk_prob
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[..., :VOCAB], expected, rtol=1e-5, atol=1e-5)
    _convert(
        "--loader", "flow", "--saver", "hf", "--load-dir", str(tmp / "flow"), "--save-dir", str(tmp / "out")
    )
    torch.testing.assert_close(hf_logits(str(tmp / "out"), tokens, caplog), expected, rtol=1e-5, atol=1e-5)
    exported = json.loads((tmp / "out" / "config.json").read_text())
    original = json.loads((tmp / "hf" / "config.json").read_text())
    keys = [
        "model_type",
        "num_experts_per_tok",
        "mlp_only_layers",
        "norm_topk_prob",
        "shared_expert_intermediate_size",
    ]
    assert {k: exported.get(k) for k in keys} == {k: original.get(k) for k in keys}


def test_served_moe_answers_transformers_greedy_tokens(converted):
    """/v1/completions and /v1/chat/completions of the server on the converted checkpoint, against `generate`."""
    _, hf_model, tmp = converted
    model, config = load_model_for_inference(str(tmp / "flow"), device="cpu")
    tokenizer = tokenizer_from_config(config.tokenizer)
    client = TestClient(create_app(model, tokenizer, LIMITS))
    hf_model.generation_config.eos_token_id = None  # both generate all 8 tokens
    messages = [{"role": "user", "content": "w3 w5 w8"}]
    for path, body, prompt in (
        ("/v1/completions", {"prompt": "w1 w2 w3 w4", "max_tokens": 8, "temperature": 0}, "w1 w2 w3 w4"),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0},
         serving_chat_format(tokenizer, None).prompt(messages)),
    ):  # fmt: skip
        response = client.post(path, content=json.dumps(body).encode())
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        prompt_ids = torch.tensor([tokenizer.tokenize(prompt)])
        with torch.no_grad():
            greedy = hf_model.generate(prompt_ids, do_sample=False, max_new_tokens=8, pad_token_id=0)
        expected = tokenizer.detokenize(greedy[0, prompt_ids.shape[1] :].tolist())
        assert (choice["message"]["content"] if "message" in choice else choice["text"]) == expected


def _megatron_moe_files(root: str, layout: str) -> None:
    """Our `megatron` save of an MoE model rewritten as Megatron-LM with `layout` writes it: `ep2` (local experts
    0-1 of two EP ranks' files), `te` (TransformerEngine's grouped `linear_fc1.weight<j>`) or `grouped` (GroupedMLP's
    `weight1` [h, experts x 2 ffn], `weight2` [experts x ffn, h])."""
    path = f"{root}/iter_0000001/mp_rank_00/model_optim_rng.pt"
    saved = megatron.read_checkpoint_file(path)
    state, ep = saved["model"], 2 if layout == "ep2" else 1
    per_rank = 4 // ep
    files = [{} for _ in range(ep)]
    for key, tensor in state.items():
        expert = megatron._SEQUENTIAL_EXPERT.match(key)
        if not expert:
            for file in files:
                file[key] = tensor
            continue
        index, linear = int(expert[2]), expert[3]
        prefix, rank = expert[1], index // per_rank
        if layout == "ep2":
            files[rank][f"{prefix}local_experts.{index % per_rank}.{linear}.weight"] = tensor
        elif layout == "te":
            files[0][f"{prefix}{linear}.weight{index}"] = tensor
        else:  # GroupedMLP: every expert's [in, out] side by side (weight1) / stacked (weight2)
            weight = "weight1" if linear == "linear_fc1" else "weight2"
            files[0].setdefault(f"{prefix}{weight}", []).append(tensor.t())
    for file in files:
        for key, value in list(file.items()):
            if isinstance(value, list):
                file[key] = torch.cat(value, dim=1 if key.endswith("weight1") else 0)
    os.remove(path)
    os.rmdir(os.path.dirname(path))
    for rank, file in enumerate(files):
        folder = megatron.rank_dir(f"{root}/iter_0000001", 0, 0, 1, rank, ep)
        os.makedirs(folder, exist_ok=True)
        saved["args"].expert_model_parallel_size = ep
        torch.save({**saved, "model": file}, f"{folder}/model_optim_rng.pt")


@pytest.mark.parametrize("layout", ["ep2", "te", "grouped"])
def test_megatron_lm_moe_checkpoints_read_to_the_same_model(layout, tmp_path):
    config, model = our_llama(untied=True, moe=True)
    weights = ModelWeights(config, trim_vocab(model.state_dict(), VOCAB))
    megatron.save(weights, str(tmp_path))
    _megatron_moe_files(str(tmp_path), layout)
    loaded = megatron.load(str(tmp_path), None, VOCAB, GPT)
    assert loaded.tensors.keys() == weights.tensors.keys()
    for name, tensor in weights.tensors.items():
        assert torch.equal(loaded.tensors[name], tensor), name
