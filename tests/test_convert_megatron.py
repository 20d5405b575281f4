"""The converter's `megatron` loader and saver: Megatron-LM's legacy torch checkpoints in and out, and refusal of
pickled objects outside the allow-list."""

from __future__ import annotations

import argparse
import io
import os
import random
import sys
import types

import numpy as np
import pytest
import torch

from megatron_train.checkpointing import load_model_for_inference
from megatron_train.convert import ModelWeights, flow
from megatron_train.convert.weights import trim_vocab
from megatron_train.models import GPTModel, TransformerConfig
from megatron_train.models.transformer import unpack_qkv
from megatron_train.tools.checkpoint_util import main
from tests.helpers.convert_models import (
    VOCAB,
    ModelType,
    WritesFile,
    ids,
    megatron_args,
    our_llama,
    shard_tensors,
)


def _convert(*argv: str) -> None:
    main(["--model-type", "GPT", *argv])


@pytest.mark.parametrize(("tp", "pp", "qkv_bias"), [(1, 1, False), (2, 2, False), (2, 2, True)])
def test_flow_to_megatron_to_flow_round_trip_is_bitwise(tp, pp, qkv_bias, tmp_path, capsys):
    config, model = our_llama(untied=False, qkv_bias=qkv_bias)
    flow.save(ModelWeights(config, trim_vocab(model.state_dict(), VOCAB)), str(tmp_path / "a"), tp, pp)
    _convert("--saver", "megatron", "--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "mg"),
             "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp))  # fmt: skip
    assert "--use-checkpoint-args" in capsys.readouterr().out
    suffix = "" if pp == 1 else "_001"
    saved = torch.load(f"{tmp_path}/mg/iter_0000001/mp_rank_01{suffix}/model_optim_rng.pt", weights_only=False) \
        if tp == 2 else None  # fmt: skip
    if (
        saved is not None
    ):  # the last stage holds its local layers 0, 1 (global 2, 3) and a copy of the embedding
        assert "decoder.layers.1.mlp.linear_fc2.weight" in saved["model"]
        assert "decoder.layers.2.mlp.linear_fc2.weight" not in saved["model"]
        assert saved["model"]["output_layer.weight"].shape == (128, 32)  # 256 padded rows over TP2
        assert (saved["args"].padded_vocab_size, saved["checkpoint_version"]) == (256, 3.0)
        assert saved["args"].add_qkv_bias == qkv_bias  # Megatron's flag, read back from its args
        assert ("decoder.layers.1.self_attention.linear_qkv.bias" in saved["model"]) == qkv_bias
    _convert("--loader", "megatron", "--load-dir", str(tmp_path / "mg"), "--save-dir", str(tmp_path / "b"),
             "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp))  # fmt: skip
    original, back = shard_tensors(f"{tmp_path}/a/iter_0000001"), shard_tensors(f"{tmp_path}/b/iter_0000001")
    assert original.keys() == back.keys() and len(original) > 4 * tp * pp
    for key, value in original.items():
        assert value == back[key] if key[1] == "metadata" else torch.equal(value, back[key]), key


def _megatron_qkv_shard(qkv: torch.Tensor, heads: int, groups: int, tp: int, rank: int) -> torch.Tensor:
    """Megatron-Core's linear_qkv on TP rank `rank`: for each of its query groups, the group's query heads, then
    its key head, then its value head (head-interleaved), built head by head from the separate projections."""
    q, k, v = unpack_qkv(qkv, groups, heads)
    d, per_group = q.shape[0] // heads, heads // groups
    rows = []
    for group in range(rank * groups // tp, (rank + 1) * groups // tp):
        rows += [q[(group * per_group + h) * d : (group * per_group + h + 1) * d] for h in range(per_group)]
        rows += [k[group * d : (group + 1) * d], v[group * d : (group + 1) * d]]
    return torch.cat(rows)


def _fake_megatron_enums(monkeypatch) -> None:
    """Make `ModelType` pickle under Megatron's module name, as a real checkpoint names it."""
    for name in ("megatron", "megatron.core", "megatron.core.enums"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(ModelType, "__module__", "megatron.core.enums")
    monkeypatch.setattr(sys.modules["megatron.core.enums"], "ModelType", ModelType, raising=False)


def test_megatron_core_checkpoint_in_megatrons_layout_gives_the_logits_of_its_model(tmp_path, monkeypatch):
    """TP2 x PP2 files as Megatron-Core + TransformerEngine write them: stage-local layer numbers, fused norm
    names, `_extra_state`, head-interleaved QKV split by query groups, SwiGLU fc1 as [gate_r; up_r], RNG state,
    an enum in args."""
    _fake_megatron_enums(monkeypatch)
    config, model = our_llama(untied=True)
    state, shape = model.state_dict(), config.model
    heads, groups, tp, pp = shape.num_attention_heads, shape.num_query_groups, 2, 2
    per_stage = shape.num_layers // pp
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            files: dict[str, torch.Tensor | io.BytesIO] = {}
            if pp_rank == 0:
                files["embedding.word_embeddings.weight"] = state["embedding.word_embeddings.weight"].chunk(
                    tp
                )[tp_rank]
            for local in range(per_stage):
                src, dst = f"decoder.layers.{pp_rank * per_stage + local}.", f"decoder.layers.{local}."
                gate, up = state[src + "mlp.linear_fc1.weight"].chunk(2)
                files |= {
                    dst + "self_attention.linear_qkv.layer_norm_weight": state[src + "input_layernorm.weight"],
                    dst + "self_attention.linear_qkv.weight": _megatron_qkv_shard(
                        state[src + "self_attention.linear_qkv.weight"], heads, groups, tp, tp_rank
                    ),
                    dst + "self_attention.linear_qkv._extra_state": io.BytesIO(b""),
                    dst + "self_attention.core_attention._extra_state": None,
                    dst + "self_attention.linear_proj.weight": state[src + "self_attention.linear_proj.weight"]
                    .chunk(tp, dim=1)[tp_rank],
                    dst + "mlp.linear_fc1.layer_norm_weight": state[src + "pre_mlp_layernorm.weight"],
                    dst + "mlp.linear_fc1.weight": torch.cat((gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank])),
                    dst + "mlp.linear_fc2.weight": state[src + "mlp.linear_fc2.weight"].chunk(tp, dim=1)[tp_rank],
                }  # fmt: skip
            if pp_rank == pp - 1:
                files["decoder.final_layernorm.weight"] = state["decoder.final_layernorm.weight"]
                files["output_layer.weight"] = state["output_layer.weight"].chunk(tp)[tp_rank]
            rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                   "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}  # fmt: skip
            folder = tmp_path / "mg" / "iter_0000020" / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
            folder.mkdir(parents=True)
            torch.save(
                {"args": megatron_args(shape, tp, pp, 128), "checkpoint_version": 3.0, "iteration": 20,
                 "model": files, "rng_state": [rng], "num_floating_point_operations_so_far": 0},
                folder / "model_optim_rng.pt",
            )  # fmt: skip
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("20")
    _convert("--loader", "megatron", "--load-dir", str(tmp_path / "mg"), "--save-dir", str(tmp_path / "flow"),
             "--true-vocab-size", str(VOCAB))  # fmt: skip
    converted, converted_config = load_model_for_inference(str(tmp_path / "flow"), device="cpu")
    assert converted_config.model.num_query_groups == groups and os.path.isdir(
        tmp_path / "flow" / "iter_0000020"
    )
    with torch.no_grad():
        torch.testing.assert_close(converted(ids()), model(ids()), rtol=0, atol=0)


def test_released_gpt_345m_layout_with_language_model_names_loads(tmp_path):
    """The older nested `language_model.*` state dict (checkpoint_version 0: QKV as [3, heads, d]) in `release/`."""
    model_config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                     hidden_dropout=0.0, attention_dropout=0.0, true_vocab_size=VOCAB)  # fmt: skip
    torch.manual_seed(5)
    model = GPTModel(model_config, 128).eval()
    state = model.state_dict()
    encoder = {}
    for i in range(2):
        src = f"decoder.layers.{i}."
        names = {"input_layernorm": "input_layernorm", "self_attention.linear_proj": "attention.dense",
                 "pre_mlp_layernorm": "post_attention_layernorm", "mlp.linear_fc1": "mlp.dense_h_to_4h",
                 "mlp.linear_fc2": "mlp.dense_4h_to_h"}  # fmt: skip
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                encoder[f"layers.{i}.{theirs}.{kind}"] = state[f"{src}{ours}.{kind}"]
        for kind in ("weight", "bias"):
            encoder[f"layers.{i}.attention.query_key_value.{kind}"] = torch.cat(
                unpack_qkv(state[f"{src}self_attention.linear_qkv.{kind}"], 4, 4)
            )
    encoder |= {"final_layernorm.weight": state["decoder.final_layernorm.weight"],
                "final_layernorm.bias": state["decoder.final_layernorm.bias"]}  # fmt: skip
    language_model = {
        "embedding": {"word_embeddings": {"weight": state["embedding.word_embeddings.weight"]},
                      "position_embeddings": {"weight": state["embedding.position_embeddings.weight"]}},
        "transformer": encoder,
    }  # fmt: skip
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                              max_position_embeddings=16, padded_vocab_size=128, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    (tmp_path / "mg" / "release" / "mp_rank_00").mkdir(parents=True)
    torch.save({"args": args, "model": {"language_model": language_model}},
               tmp_path / "mg" / "release" / "mp_rank_00" / "model_optim_rng.pt")  # fmt: skip
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("release")
    _convert("--loader", "megatron", "--load-dir", str(tmp_path / "mg"), "--save-dir", str(tmp_path / "flow"),
             "--true-vocab-size", str(VOCAB))  # fmt: skip
    converted, _ = load_model_for_inference(str(tmp_path / "flow"), device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(converted(ids()), model(ids()), rtol=0, atol=0)


def test_pickled_object_outside_the_allow_list_is_refused_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "written_by_the_checkpoint"
    (tmp_path / "mg" / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    torch.save({"args": argparse.Namespace(hook=WritesFile(str(marker))), "model": {}},
               tmp_path / "mg" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")  # fmt: skip
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(SystemExit):
        _convert(
            "--loader", "megatron", "--load-dir", str(tmp_path / "mg"), "--save-dir", str(tmp_path / "out")
        )
    error = capsys.readouterr().err
    assert "model_optim_rng.pt holds pickled objects of" in error and "'pathlib.Path'" in error, error
    assert "could run code, so it is not loaded" in error
    assert not marker.exists() and not (tmp_path / "out").exists()
