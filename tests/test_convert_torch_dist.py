"""The converter's `torch_dist` loader and saver: Megatron-Core's distributed checkpoint (PyTorch DCP) in and out."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megatron_train.checkpointing import CheckpointError, load_model_for_inference
from megatron_train.convert import ModelWeights, flow, torch_dist
from megatron_train.convert.weights import trim_vocab
from megatron_train.families.gpt import GPT
from megatron_train.tools.checkpoint_util import main
from tests.helpers.convert_models import VOCAB, WritesFile, ids, megatron_args, our_llama, shard_tensors


def _convert(*argv: str) -> None:
    main(["--model-type", "GPT", *argv])


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize(
    ("tp", "pp", "untied", "qkv_bias"), [(1, 1, False, False), (2, 2, False, False), (2, 2, True, False),
                                         (2, 2, True, True)]
)  # fmt: skip
def test_flow_to_torch_dist_to_flow_round_trip_is_bitwise(tp, pp, untied, qkv_bias, tmp_path, capsys):
    config, model = our_llama(untied, qkv_bias)
    flow.save(ModelWeights(config, trim_vocab(model.state_dict(), VOCAB)), str(tmp_path / "a"), tp, pp)
    _convert("--saver", "torch_dist", "--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "td"),
             "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp))  # fmt: skip
    assert "--ckpt-format torch_dist" in capsys.readouterr().out
    saved = tmp_path / "td" / "iter_0000001"
    assert (tmp_path / "td" / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert json.loads((saved / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert sorted(name for name in os.listdir(saved) if name.endswith(".distcp")) == [
        f"__{rank}_0.distcp" for rank in range(tp * pp)
    ]
    layout = FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    # Megatron-Core's keys: layers stacked on a first axis, fc1 as the whole [gate; up] in 2 chunks per TP rank
    fc1 = layout["decoder.layers.mlp.linear_fc1.weight"]
    assert tuple(fc1.size) == (4, 128, 32) and len(fc1.chunks) == 4 * 2 * tp
    assert tuple(layout["embedding.word_embeddings.weight"].size) == (128 * tp, 32)  # padded rows kept
    assert ("output_layer.weight" in layout) == untied  # a tied output layer is the embedding
    assert ("decoder.layers.self_attention.linear_qkv.bias" in layout) == qkv_bias
    assert "decoder.layers.self_attention.linear_qkv._extra_state/shard_3_4" in layout
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in layout  # the norms by their fused names
    assert (saved / "common.pt").exists()  # the args, where every Megatron-Core version looks
    assert not any(key.startswith("decoder.layers.0.") for key in layout)
    _convert("--loader", "torch_dist", "--load-dir", str(tmp_path / "td"), "--save-dir", str(tmp_path / "b"),
             "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp))  # fmt: skip
    original, back = shard_tensors(f"{tmp_path}/a/iter_0000001"), shard_tensors(f"{tmp_path}/b/iter_0000001")
    assert original.keys() == back.keys() and len(original) > 4 * tp * pp
    for key, value in original.items():
        assert value == back[key] if key[1] == "metadata" else torch.equal(value, back[key]), key


def _megatron_core_save(folder, state: dict, common: dict) -> None:
    """A torch_dist folder written with DCP directly as Megatron-Core lays it out: TransformerEngine's fused norm
    names, layers stacked, the common state as the `common_state` object (DCP torch.saves it)."""
    stacked: dict[str, list[torch.Tensor]] = {}
    flat = {"common_state/shard_0_1": [common]}
    for name, tensor in state.items():
        if name.startswith("decoder.layers."):
            rest = name.split(".", 3)[3]
            rest = rest.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
            rest = rest.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
            stacked.setdefault(f"decoder.layers.{rest}", []).append(tensor)
        else:
            flat[name] = tensor
    flat |= {key: torch.stack(layers) for key, layers in stacked.items()}
    dcp.save(
        flat, checkpoint_id=str(folder), no_dist=True, planner=DefaultSavePlanner(flatten_state_dict=False)
    )
    (folder / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )


def test_megatron_core_torch_dist_checkpoint_gives_the_logits_of_its_model(tmp_path):
    config, model = our_llama(untied=True)
    folder = tmp_path / "td" / "iter_0000020"
    args = megatron_args(config.model, 2, 2, 128)
    args.model_type = None  # the enum stand-in needs Megatron's module; test_convert_megatron covers it
    _megatron_core_save(
        folder, model.state_dict(), {"args": args, "checkpoint_version": 3.0, "iteration": 20}
    )
    (tmp_path / "td" / "latest_checkpointed_iteration.txt").write_text("20")
    _convert("--loader", "torch_dist", "--load-dir", str(tmp_path / "td"), "--save-dir", str(tmp_path / "flow"),
             "--true-vocab-size", str(VOCAB))  # fmt: skip
    converted, converted_config = load_model_for_inference(str(tmp_path / "flow"), device="cpu")
    assert converted_config.model.num_query_groups == 2 and os.path.isdir(tmp_path / "flow" / "iter_0000020")
    with torch.no_grad():
        torch.testing.assert_close(converted(ids()), model(ids()), rtol=0, atol=0)


def test_pickled_objects_outside_the_allow_list_are_refused_and_run_nothing(tmp_path, capsys):
    marker = tmp_path / "written_by_the_checkpoint"
    config, model = our_llama(untied=True)
    folder = tmp_path / "td" / "iter_0000001"
    args = megatron_args(config.model, 1, 1, 128)
    args.model_type, args.hook = None, WritesFile(str(marker))
    _megatron_core_save(folder, model.state_dict(), {"args": args, "iteration": 1})
    (tmp_path / "td" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(SystemExit):
        _convert(
            "--loader", "torch_dist", "--load-dir", str(tmp_path / "td"), "--save-dir", str(tmp_path / "out")
        )
    error = capsys.readouterr().err
    assert "(common_state/shard_0_1) holds pickled objects of" in error and "'pathlib.Path'" in error, error
    # DCP's own index is a plain pickle: a crafted one is refused too
    with open(folder / ".metadata", "wb") as handle:
        pickle.dump(WritesFile(str(marker)), handle)
    with pytest.raises(SystemExit):
        _convert(
            "--loader", "torch_dist", "--load-dir", str(tmp_path / "td"), "--save-dir", str(tmp_path / "out")
        )
    assert ".metadata names pathlib" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_moe_model_of_dense_and_moe_layers_round_trips_with_megatron_core_expert_keys(tmp_path):
    """Layers 1 and 3 MoE (4 experts, a gated shared expert), saved from TP2 x PP2: every key per layer as
    Megatron-Core saves a model of unlike layers, each expert's Linear [out, in] on an expert axis (fc1's [gate; up]
    cut over TP per expert), an `_extra_state` per expert; read back bitwise at TP1 x PP1; args that lie about the
    experts are refused."""
    config, model = our_llama(True, moe=True, moe_layer_freq="([0]+[1])*2")
    flow.save(ModelWeights(config, trim_vocab(model.state_dict(), VOCAB)), str(tmp_path / "a"))
    _convert("--saver", "torch_dist", "--load-dir", str(tmp_path / "a"), "--save-dir", str(tmp_path / "td"),
             "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")  # fmt: skip
    layout = FileSystemReader(str(tmp_path / "td" / "iter_0000001")).read_metadata().state_dict_metadata
    fc1 = layout["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"]
    assert tuple(fc1.size) == (4, 32, 32) and len(fc1.chunks) == 2 * 2  # [gate; up] of 16 rows each, TP 2
    assert tuple(layout["decoder.layers.3.mlp.experts.experts.linear_fc2.weight"].size) == (4, 32, 16)
    assert tuple(layout["decoder.layers.3.mlp.router.weight"].size) == (4, 32)
    assert tuple(layout["decoder.layers.1.mlp.shared_experts.gate_weight"].size) == (1, 32)
    assert tuple(layout["decoder.layers.0.mlp.linear_fc1.weight"].size) == (128, 32)
    assert "decoder.layers.3.mlp.experts.experts.linear_fc2._extra_state/shard_2_4" in layout
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1._extra_state/shard_0_1" in layout
    assert not any(key.startswith("decoder.layers.mlp") for key in layout)  # no stacked key
    saved = {"decoder.layers.1.mlp.experts.experts.linear_fc1.weight": torch.empty(4, 32, 32)}
    dcp.load(saved, checkpoint_id=str(tmp_path / "td" / "iter_0000001"), no_dist=True)
    weight1 = model.state_dict()["decoder.layers.1.mlp.experts.weight1"]  # [experts, h, gate | up]
    assert torch.equal(
        saved["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"], weight1.transpose(1, 2)
    )
    _convert("--loader", "torch_dist", "--load-dir", str(tmp_path / "td"), "--save-dir", str(tmp_path / "b"))
    original, back = shard_tensors(f"{tmp_path}/a/iter_0000001"), shard_tensors(f"{tmp_path}/b/iter_0000001")
    assert original.keys() == back.keys()
    for key, value in original.items():
        assert value == back[key] if key[1] == "metadata" else torch.equal(value, back[key]), key
    common = torch.load(tmp_path / "td" / "iter_0000001" / "common.pt", weights_only=False)
    common["args"].num_experts = 8  # args that lie about the experts: refused before a tensor is read
    torch.save(common, tmp_path / "td" / "iter_0000001" / "common.pt")
    with pytest.raises(
        CheckpointError, match=r"router.weight has shape \[4, 32\], but the args .* make it \[8, 32\]"
    ):
        torch_dist.load(str(tmp_path / "td"), None, VOCAB, GPT)
