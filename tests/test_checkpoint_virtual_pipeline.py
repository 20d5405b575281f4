"""Checkpoints of interleaved pipelines (virtual stages). `pretrain_gpt` at PP2 x 2 virtual stages saves at
iteration 2; resumed in the same layout it logs the uninterrupted run's losses bitwise (with and without
dropout), resumed as PP1 (DP2) or as a plain PP2 it logs them to 1e-5 (with the plain or the distributed
optimizer), and a plain PP2 checkpoint resumes as PP2 x 2 virtual stages. The files hold global names; the converter lays files out for virtual stages or not
and refuses layouts that do not split."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

from megatron_train.arguments import parse_args
from megatron_train.checkpointing import (
    CheckpointError,
    SavedCheckpoint,
    TrainingProgress,
    checkpoint_dir,
    load_model_for_inference,
    model_shard_dir,
    save_checkpoint,
)
from megatron_train.checkpointing.layout import OUTPUT_WEIGHT, WORD_EMBEDDING
from megatron_train.models.gpt import GPTModel
from megatron_train.parallel import state
from megatron_train.tools.checkpoint_util import convert_checkpoint, main
from tests.helpers.distributed import run_distributed
from tests.helpers.training import pretrain_worker, tiny_args, write_corpus

pytestmark = pytest.mark.processes  # every test here starts processes

SAVED_AT = 2  # every run trains 4 iterations; the resumed ones start from the iteration-2 checkpoint
RTOL = 1e-5
# 4 layers, PP 2, global batch 8 in micro-batches of 2 (4 micro-batches: a multiple of PP for interleaving)
COMMON = ("--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
          "--train-iters", "4", "--split", "90,10,0")  # fmt: skip
VIRTUAL = ("--num-layers-per-virtual-pipeline-stage", "1")  # 2 chunks of 1 layer per rank
NO_DROPOUT = ("--hidden-dropout", "0.0", "--attention-dropout", "0.0")  # another layout draws other masks
SAVE = ("--save-interval", str(SAVED_AT))
DISTRIBUTED = ("--use-distributed-optimizer",)  # its state_dict names chunk params `<chunk>.<name>` too
# name: (the run whose iteration-2 checkpoint it resumes from, or None for a run from scratch; its flags)
RUNS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "virtual": (None, (*VIRTUAL, *NO_DROPOUT, *SAVE)),
    "virtual-resumed": ("virtual", (*VIRTUAL, *NO_DROPOUT)),
    "virtual-as-pp1": ("virtual", ("--pipeline-model-parallel-size", "1", *NO_DROPOUT, "--no-load-rng")),
    "virtual-as-pp2": ("virtual", (*NO_DROPOUT, "--no-load-rng")),
    "pp2": (None, (*NO_DROPOUT, *SAVE)),
    "pp2-as-virtual": ("pp2", (*VIRTUAL, *NO_DROPOUT)),
    "dropout": (None, (*VIRTUAL, *SAVE)),
    "dropout-resumed": ("dropout", VIRTUAL),
    # DP 1 when saved (each rank holds all its chunks' state); DP 2 when resumed (each rank takes its half)
    "distributed": (None, (*VIRTUAL, *DISTRIBUTED, *NO_DROPOUT, *SAVE)),
    "distributed-as-pp1": (
        "distributed",
        ("--pipeline-model-parallel-size", "1", *DISTRIBUTED, *NO_DROPOUT, "--no-load-rng"),
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, dict[str, list[dict]]]:
    """Every run of RUNS in one 2-rank process group: (their parent folder, each run's metrics records)."""
    tmp = str(tmp_path_factory.mktemp("virtual"))
    data = ("--data-path", write_corpus(tmp))
    argvs = []
    for name, (source, flags) in RUNS.items():
        load = ("--load", os.path.join(tmp, source), "--ckpt-step", str(SAVED_AT)) if source else ()
        argvs.append(tiny_args(os.path.join(tmp, name), *data, *COMMON, *flags, *load))
    last_rank = run_distributed(pretrain_worker, 2, argvs, timeout=300)[-1]
    return tmp, dict(zip(RUNS, last_rank, strict=True))


def _train(records: list[dict], key: str) -> list:
    return [r[key] for r in records if "split" not in r]


@pytest.mark.parametrize("reference", ["virtual", "dropout"])
def test_resume_in_the_same_virtual_layout_is_bitwise(runs, reference) -> None:
    _, metrics = runs
    expected, resumed = metrics[reference], metrics[f"{reference}-resumed"]
    assert len(set(_train(expected, "lm loss"))) == 4  # it trained
    assert _train(resumed, "iteration") == [3, 4]
    for key in ("lm loss", "grad norm", "learning rate", "consumed samples"):
        assert _train(resumed, key) == _train(expected, key)[SAVED_AT:], key


@pytest.mark.parametrize(
    ("resumed", "reference"),
    [
        ("virtual-as-pp1", "virtual"),
        ("virtual-as-pp2", "virtual"),
        ("pp2-as-virtual", "pp2"),
        ("distributed-as-pp1", "distributed"),
    ],
)
def test_resume_in_another_virtual_layout_trains_on(runs, resumed, reference) -> None:
    _, metrics = runs
    expected, result = metrics[reference], metrics[resumed]
    assert _train(result, "iteration") == [3, 4]
    for key in ("lm loss", "grad norm"):
        np.testing.assert_allclose(
            _train(result, key), _train(expected, key)[SAVED_AT:], rtol=RTOL, err_msg=f"{resumed}: {key}"
        )
    for key in ("learning rate", "consumed samples"):  # the scheduler and the data position resumed exactly
        assert _train(result, key) == _train(expected, key)[SAVED_AT:], key


def _file_names(iteration_dir: str, pp_rank: int, kind: str = "model") -> set[str]:
    path = os.path.join(model_shard_dir(iteration_dir, 0, pp_rank, 2), f"{kind}.safetensors")
    with safe_open(path, framework="pt") as handle:
        return set(handle.keys())


def _layers(names: set[str]) -> set[int]:
    return {int(name.split(".")[2]) for name in names if name.startswith("decoder.layers.")}


def test_each_rank_saves_its_chunks_under_global_names(runs) -> None:
    tmp, _ = runs
    virtual, plain = checkpoint_dir(f"{tmp}/virtual", SAVED_AT), checkpoint_dir(f"{tmp}/pp2", SAVED_AT)
    first, last = _file_names(virtual, 0), _file_names(virtual, 1)
    assert _layers(first) == {0, 2} and _layers(last) == {1, 3}  # chunk c of rank r: layer 2c + r
    assert WORD_EMBEDDING in first and "embedding.position_embeddings.weight" in first
    assert "decoder.final_layernorm.weight" in last
    assert OUTPUT_WEIGHT not in first | last and WORD_EMBEDDING not in last  # the tied copy is saved once
    assert first | last == _file_names(plain, 0) | _file_names(plain, 1)
    # Adam state under the same global names, one per trained tensor
    optimizer = _file_names(virtual, 0, "optimizer") | _file_names(virtual, 1, "optimizer")
    assert {name.rsplit(".", 1)[0] for name in optimizer} == first | last
    saved = SavedCheckpoint(virtual)
    assert saved.metadata["virtual_pipeline_model_parallel_size"] == 2
    assert saved.metadata["args"]["parallel"]["num_layers_per_virtual_pipeline_stage"] == 1
    assert sorted(saved.optimizer_meta_for({n: n for n in saved.params})["scalars"]) == sorted(saved.params)


def test_inference_loads_a_virtual_checkpoint(runs) -> None:
    tmp, _ = runs
    model, config = load_model_for_inference(f"{tmp}/virtual", SAVED_AT, device="cpu")
    saved = SavedCheckpoint(checkpoint_dir(f"{tmp}/virtual", SAVED_AT))
    assert config.parallel.num_layers_per_virtual_pipeline_stage == 1
    weights = model.state_dict()  # one process: the output layer is the word embedding itself
    assert set(weights) == set(saved.params)
    for name, tensor in weights.items():
        assert torch.equal(tensor, saved.global_tensor(name)), name


def _assert_same_tensors(source: str, converted: str) -> None:
    """Every weight and optimizer tensor of `converted` equals `source`'s."""
    before, after = SavedCheckpoint(source), SavedCheckpoint(converted)
    assert list(after.params) == list(before.params)
    names = {name: name for name in before.params}
    optimizer_names = list(before.optimizer_tensor_names(names))
    assert list(after.optimizer_tensor_names(names)) == optimizer_names
    for name in before.params:
        assert torch.equal(after.global_tensor(name), before.global_tensor(name)), name
    for name in optimizer_names:
        assert torch.equal(after.global_tensor(name, "optimizer"), before.global_tensor(name, "optimizer")), (
            name
        )
    assert after.optimizer_meta_for(names) == before.optimizer_meta_for(names)


def test_converter_lays_files_out_with_or_without_virtual_stages(runs, tmp_path, capsys) -> None:
    tmp, _ = runs
    virtual, plain = checkpoint_dir(f"{tmp}/virtual", SAVED_AT), checkpoint_dir(f"{tmp}/pp2", SAVED_AT)
    # a virtual checkpoint to a plain PP2 layout (the default): contiguous layers per stage
    out = convert_checkpoint(f"{tmp}/virtual", str(tmp_path / "plain"), iteration=SAVED_AT)
    assert _layers(_file_names(out, 0)) == {0, 1} and _layers(_file_names(out, 1)) == {2, 3}
    assert SavedCheckpoint(out).metadata["virtual_pipeline_model_parallel_size"] is None
    assert SavedCheckpoint(out).metadata["args"]["parallel"]["num_layers_per_virtual_pipeline_stage"] is None
    _assert_same_tensors(virtual, out)
    # a plain checkpoint to virtual stages (the CLI): the files an interleaved run writes
    main(["--load-dir", f"{tmp}/pp2", "--save-dir", str(tmp_path / "virtual"), "--iteration", str(SAVED_AT),
          "--target-num-layers-per-virtual-pipeline-stage", "1"])  # fmt: skip
    out = checkpoint_dir(str(tmp_path / "virtual"), SAVED_AT)
    assert "wrote" in capsys.readouterr().out
    for pp_rank in (0, 1):
        assert _file_names(out, pp_rank) == _file_names(virtual, pp_rank)
        assert _file_names(out, pp_rank, "optimizer") == _file_names(virtual, pp_rank, "optimizer")
    metadata = SavedCheckpoint(out).metadata
    assert metadata["virtual_pipeline_model_parallel_size"] == 2
    assert metadata["args"]["parallel"]["num_layers_per_virtual_pipeline_stage"] == 1
    _assert_same_tensors(plain, out)


@pytest.mark.parametrize(
    ("target_pp", "layers_per_virtual_stage", "error"),
    [(1, 1, "need a target pipeline model parallel size > 1"), (2, 3, "does not split into virtual stages")],
)
def test_converter_refuses_virtual_layouts_that_do_not_split(
    runs, tmp_path, target_pp, layers_per_virtual_stage, error
) -> None:
    tmp, _ = runs
    with pytest.raises(ValueError, match=error):
        convert_checkpoint(
            f"{tmp}/pp2",
            str(tmp_path),
            target_pp=target_pp,
            target_layers_per_virtual_stage=layers_per_virtual_stage,
        )
    assert not os.listdir(tmp_path)


def _save_one_chunk_of_two(rank: int, world_size: int, save: str) -> str:
    """Save one module where the run has 2 virtual stages per rank; returns the error."""
    config = parse_args(tiny_args(save, "--num-layers", "4", "--train-iters", "1"), world_size)
    state.initialize_model_parallel(1, 1, 2)
    try:
        save_checkpoint(1, GPTModel(config.model, 128), None, None, TrainingProgress(), config, 128)
    except CheckpointError as error:
        return str(error)
    finally:
        state.destroy_model_parallel()
    return "saved"


def test_save_refuses_chunks_that_do_not_match_the_virtual_stages(tmp_path) -> None:
    error = run_distributed(_save_one_chunk_of_two, 1, str(tmp_path))[0]
    assert "got 1 model chunks but this run has 2 virtual pipeline stages per rank" in error
    assert not os.listdir(tmp_path)  # nothing written
