"""Every loader checks the config it reads (config.json, Megatron's args in a legacy file or torch_dist's common
state, our metadata.json) against its types and against the tensors before it builds or allocates anything; files
of a source folder are regular files inside it, and their headers are bounded before they are read."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_train.checkpointing import CheckpointError
from megatron_train.convert import ModelWeights, flow, megatron, torch_dist
from megatron_train.convert.weights import trim_vocab
from megatron_train.tools.checkpoint_util import load_weights
from tests.helpers.convert_models import VOCAB, our_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """A Hugging Face GPT-2 folder (100 x 32 embedding, 16 positions, 2 layers) and the tiny Llama in our, Megatron's
    legacy and torch_dist formats."""
    root = tmp_path_factory.mktemp("sources")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "hf")
    (root / "hf" / "vocab.json").write_text(json.dumps({"a": 0}))
    (root / "hf" / "merges.txt").write_text("#version: 0.2\n")
    model_config, model = our_llama(untied=True)
    flow.save(ModelWeights(model_config, trim_vocab(model.state_dict(), VOCAB)), str(root / "flow"))
    megatron.save(flow.load(str(root / "flow")), str(root / "megatron"))
    torch_dist.save(flow.load(str(root / "flow")), str(root / "torch_dist"))
    return {name: str(root / name) for name in ("hf", "flow", "megatron", "torch_dist")}


def _copy(sources: dict[str, str], name: str, tmp_path) -> str:
    shutil.copytree(sources[name], tmp_path / name, symlinks=True)
    return str(tmp_path / name)


def _refusal(loader: str, folder: str) -> str:
    with pytest.raises((ValueError, CheckpointError)) as refused:
        load_weights(loader, folder, None, None, "GPT")
    return str(refused.value)


def _edit_json(path: str, edit) -> None:
    with open(path) as handle:
        data = json.load(handle)
    edit(data)
    with open(path, "w") as handle:
        json.dump(data, handle)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("n_embd", 256, "n_embd is 256, but transformer.wte.weight in the weights of {folder} has shape [100, 32]"),
        ("n_positions", 4096, "n_positions is 4096, but transformer.wpe.weight in the weights of {folder} has shape "
                              "[16, 32]"),
        ("vocab_size", 64, "vocab_size is 64, but transformer.wte.weight in the weights of {folder} has shape "
                           "[100, 32]"),  # cut the embedding to 128 padded rows before, silently
        ("vocab_size", 10**12, "vocab_size is 1000000000000, but transformer.wte.weight in the weights of {folder} "
                               "has shape [100, 32]"),  # tried to allocate 512 TB before
        ("n_head", 0, "n_head is 0; it must be at least 1"),  # ZeroDivisionError before
        ("n_head", 3, "n_embd 32 is not divisible by n_head 3"),
        ("n_layer", 10**6, "n_layer is 1000000, but there are 2 layers (transformer.h.0 .. transformer.h.1) in the "
                           "weights of {folder}"),  # built for minutes before
        ("n_layer", "2", "n_layer is '2', not an integer"),
        ("n_inner", 96, "its sizes (n_layer 2, n_embd 32, n_head 4, n_positions 16, vocab_size 100, n_inner 96, "
                        "layer_norm_epsilon 1e-05, resid_pdrop 0.1, attn_pdrop 0.1) make "
                        "transformer.h.0.mlp.c_fc.weight [32, 96], but in the weights of {folder} it is [32, 128]"),
        ("layer_norm_epsilon", -1, "layer_norm_epsilon is -1; it must lie in [0.0, inf]"),
        ("activation_function", 3, "activation_function is 3, not a string"),
    ],
)  # fmt: skip
def test_a_lying_config_json_is_refused_naming_the_file_the_field_and_the_value(
    sources, tmp_path, key, value, message
):
    folder = _copy(sources, "hf", tmp_path)
    _edit_json(f"{folder}/config.json", lambda config: config.update({key: value}))
    different = "; the config and the weights come from different models"
    assert _refusal("hf", folder) == f"{folder}/config.json: " + message.format(folder=folder) + (
        different if "has shape" in message or "make" in message else ""
    )


def _edit_args(path: str, **changes) -> None:
    state = torch.load(path, weights_only=False)
    state["args"] = argparse.Namespace(**{**vars(state["args"]), **changes})
    torch.save(state, path)


def test_lying_megatron_args_in_a_legacy_file_are_refused(sources, tmp_path):
    folder = _copy(sources, "megatron", tmp_path)
    path, iteration = f"{folder}/iter_0000001/mp_rank_00/model_optim_rng.pt", f"{folder}/iter_0000001"
    cases = [
        ({"num_layers": 10**6}, f"{path}: args.num_layers is 1000000, but there are 4 layers (decoder.layers.0 .. "
                                f"decoder.layers.3) in {iteration}"),
        ({"hidden_size": "128"}, f"{path} (args): hidden_size is '128', not an integer"),
        ({"num_attention_heads": 0}, f"{path} (args): num_attention_heads is 0; it must be at least 1"),
        ({"tensor_model_parallel_size": 2}, f"{path} (args): tensor_model_parallel_size 2 x "
                                            f"pipeline_model_parallel_size 1 = 2 ranks, but {iteration} holds 1 rank "
                                            "folders (mp_rank_00)"),
        ({"padded_vocab_size": 10**12}, f"{path} (args): true_vocab_size is 100, but padded_vocab_size "
                                        "1000000000000 holds a tokenizer of 999999999873 to 1000000000000 tokens; the "
                                        "args are not the checkpoint's own"),
        ({"ffn_hidden_size": 96}, f"{path}: decoder.layers.0.mlp.linear_fc1.weight has shape [128, 32], but the args "
                                  "(hidden_size, num_attention_heads, ffn_hidden_size, padded_vocab_size, ...) make each "
                                  "of its 1 shard(s) [192, 32]; the args and the weights come from different models"),
    ]  # fmt: skip
    original = pathlib.Path(path).read_bytes()
    for changes, message in cases:
        _edit_args(path, **changes)
        assert _refusal("megatron", folder) == message, changes
        pathlib.Path(path).write_bytes(original)


def test_lying_megatron_args_in_a_torch_dist_common_state_are_refused(sources, tmp_path):
    folder = _copy(sources, "torch_dist", tmp_path)
    path, iteration = f"{folder}/iter_0000001/common.pt", f"{folder}/iter_0000001"
    index = f"{iteration}/.metadata"
    cases = [
        ({"num_layers": 10**6}, f"{index}: decoder.layers.self_attention.linear_qkv.layer_norm_weight stacks 4 layers, "
                                "but args.num_layers is 1000000; the args and the weights come from different models"),
        ({"hidden_size": "128"}, f"{iteration} (args): hidden_size is '128', not an integer"),
        ({"num_attention_heads": 0}, f"{iteration} (args): num_attention_heads is 0; it must be at least 1"),
        ({"padded_vocab_size": 200}, f"{index}: embedding.word_embeddings.weight has shape [128, 32], but the args "
                                     "(hidden_size, num_attention_heads, ffn_hidden_size, num_experts, moe_ffn_hidden_size, "
                                     "padded_vocab_size, ...) make it [200, 32]; the args and the weights come from "
                                     "different models"),
    ]  # fmt: skip
    original = pathlib.Path(path).read_bytes()
    for changes, message in cases:
        _edit_args(path, **changes)
        assert _refusal("torch_dist", folder) == message, changes
        pathlib.Path(path).write_bytes(original)


def test_a_lying_metadata_json_of_ours_is_refused(sources, tmp_path):
    folder = _copy(sources, "flow", tmp_path)
    meta, iteration = f"{folder}/iter_0000001/metadata.json", f"{folder}/iter_0000001"
    cases = [
        (lambda m: m["args"]["model"].update(num_layers=10**6),
         f"{meta}: args.model.num_layers is 1000000, but there are 4 layers (decoder.layers.0 .. decoder.layers.3) "
         "in its shard files"),
        (lambda m: m["args"]["model"].update(hidden_size="128"),
         f"{meta} (args.model): hidden_size is '128', not an integer"),
        (lambda m: m["args"]["model"].update(num_attention_heads=0),
         f"{meta} (args.model): num_attention_heads is 0; it must be at least 1"),
        (lambda m: m.update(padded_vocab_size=10**12),
         f"{meta}: its sizes (num_layers 4, hidden_size 32, ffn_hidden_size 64) make embedding.word_embeddings.weight "
         f"[1000000000000, 32], but in the shard files of {iteration} it is [128, 32]; the config and the weights "
         "come from different models"),
        (lambda m: m.update(tensor_model_parallel_size=0),
         f"{meta}: tensor_model_parallel_size is 0, not an integer of at least 1"),
        (lambda m: m.update(pipeline_model_parallel_size=10**6),
         f"{meta}: tensor_model_parallel_size 1 x pipeline_model_parallel_size 1000000, but {iteration} holds 1 rank "
         "folders"),
        (lambda m: m["args"]["model"].update(true_vocab_size=64),
         f"{meta}: args.model.true_vocab_size is 64, but the checkpoint's padded vocabulary holds a tokenizer of 100 "
         "to 100 tokens; the args are not its own"),
    ]  # fmt: skip
    original = pathlib.Path(meta).read_bytes()
    for edit, message in cases:
        _edit_json(meta, edit)
        assert _refusal("flow", folder) == message
        pathlib.Path(meta).write_bytes(original)


def test_symlinks_out_of_the_source_and_weight_map_names_are_refused(sources, tmp_path):
    folder = _copy(sources, "hf", tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"not": "a vocabulary"}))
    os.remove(f"{folder}/vocab.json")
    os.symlink(secret, f"{folder}/vocab.json")  # followed and copied into the output's tokenizer/ before
    assert _refusal("hf", folder) == (
        f"{folder}/vocab.json: a tokenizer file resolves to {secret}, outside {folder}; a model folder's files must "
        "lie inside it (copy the file in instead of linking it)"
    )
    os.remove(f"{folder}/vocab.json")
    os.symlink(f"{folder}/merges.txt", f"{folder}/vocab.json")  # a link inside the folder is followed
    assert (
        load_weights("hf", folder, None, None, "GPT").tokenizer_files["vocab.json"] == f"{folder}/vocab.json"
    )
    os.rename(f"{folder}/model.safetensors", f"{folder}/model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {"transformer.wte.weight": "../../etc/passwd"}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _refusal("hf", folder) == (
        f"{folder}: model.safetensors.index.json's weight_map names '../../etc/passwd', which is not a file name in "
        "the folder (no folders, no '..')"
    )
    os.symlink(tmp_path / "secret.json", f"{folder}/outside.safetensors")
    index["weight_map"] = {"transformer.wte.weight": "outside.safetensors"}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _refusal("hf", folder) == (
        f"{folder}/outside.safetensors: model.safetensors.index.json's weight_map resolves to {secret}, outside "
        f"{folder}; a model folder's files must lie inside it (copy the file in instead of linking it)"
    )


def test_headers_and_metadata_are_bounded_before_they_are_read(sources, tmp_path, monkeypatch):
    folder = _copy(sources, "hf", tmp_path)
    weights = f"{folder}/model.safetensors"
    with open(weights, "r+b") as handle:
        handle.write((1 << 40).to_bytes(8, "little"))  # a header of a terabyte
    assert _refusal("hf", folder) == (
        f"{weights} is not a readable safetensors file (its header size field says {1 << 40} bytes in a file of "
        f"{os.path.getsize(weights)}): the download or copy is truncated or corrupt; fetch the file again"
    )
    from megatron_train.convert import source

    monkeypatch.setattr(source, "MAX_JSON_BYTES", 100)
    folder = _copy(sources, "hf", tmp_path / "big")
    size = os.path.getsize(f"{folder}/config.json")
    assert _refusal("hf", folder) == (
        f"{folder}/config.json: {size} bytes, over the 100 bytes a file of this kind may have; it is not the file it "
        "is named after"
    )
    from megatron_train.checkpointing import dcp

    monkeypatch.setattr(dcp, "MAX_DCP_METADATA_BYTES", 100)
    folder = _copy(sources, "torch_dist", tmp_path)
    size = os.path.getsize(f"{folder}/iter_0000001/.metadata")
    assert _refusal("torch_dist", folder) == (
        f"{folder}/iter_0000001/.metadata: {size} bytes, over the 100 bytes a DCP index may have; it is not the index "
        "of a checkpoint"
    )


@pytest.mark.processes
def test_fuzzed_configs_end_in_a_named_error_or_the_sources_tensors(tmp_path):
    """Three hundred seeded random edits of the sizes, types and signs in config.json, Megatron's args (legacy
    and torch_dist) and our metadata.json, in a subprocess whose address space is capped 1 GiB above what it holds
    (tests/helpers/convert_fuzz.py): none allocates what a lie implies, hangs, or ends in anything but a named error or
    the unedited source's tensors."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.convert_fuzz", str(tmp_path), "0", "300"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["cases"] == 300 and summary["refused"] > 150 and summary["loaded"] > 20, summary


def test_damaged_files_are_one_error_naming_them(sources, tmp_path):
    """Bytes that are not what the file's name says: a CheckpointError naming the file, not torch's ValueError,
    RuntimeError or OSError (which named no file) or an AttributeError."""
    cases = [
        ("megatron", "iter_0000001/mp_rank_00/model_optim_rng.pt", b"\x00" * 3000,
         "{path} is not a complete torch.save file (truncated or damaged: Expected input to be a checkpoint returned "
         "by torch.save): copy it again from where Megatron-LM saved it, or load another iteration"),
        ("torch_dist", "iter_0000001/common.pt", b"PK\x03\x04 not a zip",
         "{path} is not a complete torch.save file (truncated or damaged: PytorchStreamReader failed reading zip "
         "archive: not a ZIP archive): copy it again from where Megatron-LM saved it, or load another iteration"),
        ("torch_dist", "iter_0000001/.metadata", b"\xa1garbage",
         "{path} is not a DCP index (UnpicklingError(\"invalid load key, '\\\\xa1'.\")); the save is damaged"),
        ("flow", "iter_0000001/metadata.json", b"[1, 2]",
         "{path}: not a checkpoint's metadata (an object whose files are {{size, hash}})"),
    ]  # fmt: skip
    for name, file, data, message in cases:
        folder = _copy(sources, name, tmp_path / file.replace("/", "_"))
        path = f"{folder}/{file}"
        pathlib.Path(path).write_bytes(data)
        assert _refusal(name, folder) == message.format(path=path), name
