"""Checkpoints: round trips of weights, optimizer, scheduler and RNG; the latest marker written last;
Megatron's --finetune / --no-load-optim / --no-load-rng; clear refusals of broken or mismatched checkpoints;
TP shards with their sharding info merged back by load_model_for_inference; every file's hash recorded and
verified on load; no run overwrites another's iterations (a lost marker, a mistyped --load); a kill during a
save leaves only files `storage.atomic.is_temporary` recognises."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing
import os
import pathlib
import random
import re
import signal
import struct
import zlib

import numpy as np
import pytest
import torch
from safetensors import safe_open

import megatron_train.checkpointing as ckpt
import megatron_train.checkpointing.save as ckpt_save
from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import (
    CheckpointError,
    load_checkpoint,
    load_model_for_inference,
    read_latest_iteration,
    save_checkpoint,
)
from megatron_train.data.config import DataConfig
from megatron_train.models.config import TransformerConfig
from megatron_train.models.gpt import GPTModel
from megatron_train.optimizer import get_megatron_optimizer
from megatron_train.parallel import model_parallel_seed, state
from megatron_train.tools.checkpoint_util import convert_checkpoint
from megatron_train.training.config import CheckpointConfig, OptimizerConfig, TrainingConfig
from megatron_train.training.lr_scheduler import build_opt_param_scheduler
from storage import atomic
from storage.fingerprint import hash_file
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import tiny_config, tiny_llama_config
from tests.helpers.training import tiny_args

VOCAB = 128


def _config(
    save_dir: str, hidden_size: int = 32, model: TransformerConfig | None = None, **checkpoint: object
) -> MegatronConfig:
    model = model or tiny_config(hidden_size=hidden_size)
    return MegatronConfig(
        model=model,
        data=DataConfig(mock_data=True),
        training=TrainingConfig(train_iters=10, global_batch_size=2),
        optimizer=OptimizerConfig(lr=1e-3, lr_warmup_iters=2),
        checkpoint=CheckpointConfig(save=save_dir, load=save_dir, **checkpoint),
    )


def _build(config: MegatronConfig, seed: int = 0):
    """Model, optimizer and scheduler; the model's full weights drawn from `seed` (--use-cpu-initialization's
    streams), whatever the TP size."""
    model_parallel_seed(seed)
    model = GPTModel(config.model, VOCAB, init_seed=seed)
    optimizer = get_megatron_optimizer(config.optimizer, model)
    scheduler = build_opt_param_scheduler(optimizer.optimizer, config.optimizer, 10, None, 2)
    return model, optimizer, scheduler


def _train_steps(model, optimizer, scheduler, steps: int) -> None:
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step))
        model(tokens, labels=tokens).mean().backward()
        optimizer.step()
        scheduler.step(2)
        optimizer.zero_grad()


def _save(config: MegatronConfig, parts, iteration: int, consumed: int = 0) -> str:
    return save_checkpoint(
        iteration, parts[0], parts[1], parts[2], ckpt.TrainingProgress(iteration, consumed, 0), config, VOCAB
    )


def test_round_trip_restores_everything(tmp_path) -> None:
    config = _config(str(tmp_path))
    saved = _build(config)
    _train_steps(*saved, steps=3)
    iteration_dir = _save(config, saved, iteration=3, consumed=6)
    expected_draws = (torch.rand(3), random.random(), np.random.rand())
    assert read_latest_iteration(str(tmp_path)) == 3
    assert sorted(os.listdir(iteration_dir)) == ["metadata.json", "mp_rank_00", "rng"]
    every_file = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert all(f.endswith((".safetensors", ".json", ".txt")) for f in every_file)  # nothing pickled

    loaded_parts = _build(config, seed=1)
    loaded = load_checkpoint(*loaded_parts, config, VOCAB)
    assert (loaded.iteration, loaded.consumed_train_samples) == (3, 6)
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == (
        expected_draws[0].tolist(),
        expected_draws[1],
        expected_draws[2],
    )
    for (name, a), b in zip(
        saved[0].state_dict().items(), loaded_parts[0].state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert loaded_parts[2].num_steps == saved[2].num_steps == 6
    assert loaded_parts[1].param_groups[0]["lr"] == saved[1].param_groups[0]["lr"]
    # both continue identically: Adam moments and step counts came back
    _train_steps(*saved, steps=1)
    _train_steps(*loaded_parts, steps=1)
    for a, b in zip(saved[0].parameters(), loaded_parts[0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_marker_is_written_only_after_a_complete_folder(tmp_path, monkeypatch) -> None:
    config = _config(str(tmp_path))
    parts = _build(config)
    _save(config, parts, iteration=1)

    def crash_on_metadata(iteration_dir: str, metadata: dict) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{iteration_dir}/metadata.json")

    monkeypatch.setattr(ckpt_save, "write_metadata", crash_on_metadata)
    with pytest.raises(ckpt.CheckpointError) as refused:
        _save(config, parts, iteration=2)
    monkeypatch.undo()
    assert str(refused.value) == (
        f"cannot save iteration 2 to --save {tmp_path}: writing {tmp_path}/iter_0000002/metadata.json failed (No "
        f"space left on device); the unfinished {tmp_path}/iter_0000002 was removed. Free space on that file "
        "system, make it writable, or pass another --save"
    )
    assert not (tmp_path / "iter_0000002").exists()
    assert read_latest_iteration(str(tmp_path)) == 1
    assert load_checkpoint(*_build(config), config, VOCAB).iteration == 1


def test_a_full_disk_while_saving_is_one_error_naming_the_file_and_leaves_no_partial_file(
    tmp_path, monkeypatch
) -> None:
    """safetensors raised its own SafetensorError ("os error 28") before, through the training loop's traceback."""
    from safetensors import SafetensorError

    from megatron_train.checkpointing import files as ckpt_files

    config = _config(str(tmp_path))
    parts = _build(config)
    _save(config, parts, iteration=1)

    def disk_fills(tensors, path, metadata=None) -> None:
        with open(path, "wb") as handle:  # the first bytes land, then the device is full
            handle.write(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt_files, "save_file", disk_fills)
    with pytest.raises(ckpt.CheckpointError) as refused:
        _save(config, parts, iteration=2)
    monkeypatch.undo()
    assert str(refused.value) == (
        f"cannot save iteration 2 to --save {tmp_path}: writing {tmp_path}/iter_0000002/mp_rank_00/"
        "model.safetensors failed (No space left on device); the unfinished "
        f"{tmp_path}/iter_0000002 was removed. Free space on that file system, make it writable, or pass another --save"
    )
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert read_latest_iteration(str(tmp_path)) == 1


def test_finetune_no_load_optim_no_load_rng(tmp_path) -> None:
    config = _config(str(tmp_path))
    saved = _build(config)
    _train_steps(*saved, steps=2)
    _save(config, saved, iteration=2, consumed=4)

    finetune = _config(str(tmp_path), finetune=True)
    parts = _build(finetune, seed=1)
    loaded = load_checkpoint(*parts, finetune, VOCAB)
    assert (loaded.iteration, loaded.consumed_train_samples) == (0, 0)
    assert parts[1].optimizer.state == {} and parts[2].num_steps == 0
    assert torch.equal(next(parts[0].parameters()), next(saved[0].parameters()))

    no_optim = _config(str(tmp_path), no_load_optim=True, no_load_rng=True)
    parts = _build(no_optim, seed=1)
    torch.manual_seed(99)
    expected = torch.rand(2)
    torch.manual_seed(99)
    loaded = load_checkpoint(*parts, no_optim, VOCAB)
    assert loaded.iteration == 2 and parts[1].optimizer.state == {}
    assert torch.equal(torch.rand(2), expected)  # RNG untouched


def test_no_marker_starts_fresh_unless_asked_to_fail(tmp_path) -> None:
    config = _config(str(tmp_path))
    assert load_checkpoint(*_build(config), config, VOCAB).iteration == 0
    strict = _config(str(tmp_path), exit_on_missing_checkpoint=True)
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt"):
        load_checkpoint(*_build(strict), strict, VOCAB)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(CheckpointError, match="should hold an iteration number"):
        load_checkpoint(*_build(config), config, VOCAB)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(CheckpointError, match="iter_0000007 does not exist"):
        load_checkpoint(*_build(config), config, VOCAB)


def test_broken_or_mismatched_checkpoints_are_refused(tmp_path) -> None:
    config = _config(str(tmp_path))
    iteration_dir = _save(config, _build(config), iteration=1)
    weights = os.path.join(iteration_dir, "mp_rank_00", "model.safetensors")

    other = _config(str(tmp_path), hidden_size=64)
    with pytest.raises(CheckpointError, match="hidden_size=32 but this run has hidden_size=64"):
        load_checkpoint(*_build(other), other, VOCAB)
    with pytest.raises(CheckpointError, match="padded_vocab_size=128 but this run has padded_vocab_size=256"):
        load_checkpoint(*_build(config), config, 256)
    llama = _config(str(tmp_path / "llama"), model=tiny_llama_config())
    _save(llama, _build(llama), iteration=1)
    qkv_bias = _config(str(tmp_path / "llama"), model=tiny_llama_config(add_qkv_bias=True))
    with pytest.raises(CheckpointError, match="add_qkv_bias=False but this run has add_qkv_bias=True"):
        load_checkpoint(*_build(qkv_bias), qkv_bias, VOCAB)

    metadata_path = os.path.join(iteration_dir, "metadata.json")
    with open(metadata_path) as handle:
        metadata = json.load(handle)
    with open(metadata_path, "w") as handle:
        json.dump({**metadata, "world_size": 2}, handle)
    with pytest.raises(
        CheckpointError, match=r"no RNG state for rank 0 of 1 \(saved by 2 ranks.*--no-load-rng"
    ):
        load_checkpoint(*_build(config), config, VOCAB)
    no_rng = _config(str(tmp_path), no_load_rng=True)
    assert load_checkpoint(*_build(no_rng), no_rng, VOCAB).iteration == 1

    with open(weights, "r+b") as handle:
        handle.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(CheckpointError, match=f"{weights} is corrupt"):
        load_checkpoint(*_build(config), config, VOCAB)
    os.remove(weights)
    with pytest.raises(CheckpointError, match=f"{weights} is missing"):
        load_checkpoint(*_build(config), config, VOCAB)

    metadata = os.path.join(iteration_dir, "metadata.json")
    with open(metadata, "w") as handle:
        handle.write("{not json")
    with pytest.raises(CheckpointError, match="metadata.json is not valid JSON"):
        load_checkpoint(*_build(config), config, VOCAB)


# The tiny GPT, and the tiny GQA Llama with Qwen2's q/k/v biases (--add-qkv-bias) alone of its linear layers
TP_MODELS = {"gpt": tiny_config, "llama_qkv_bias": lambda: tiny_llama_config(add_qkv_bias=True)}


def _fill_qkv_biases(model: GPTModel) -> None:
    """Values for the QKV biases (they start at zero, and would show nothing): this TP rank's rows of one
    vector per layer, as ColumnParallelLinear splits its bias."""
    tp, rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_qkv.bias"):
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                param.copy_(torch.randn(param.numel() * tp, generator=generator).chunk(tp)[rank])


def _tp_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def _tp_save_worker(rank: int, world_size: int, save_dir: str, arch: str) -> tuple[dict, torch.Tensor]:
    """Save a TP=world_size model; its shard's sharding records and the model's (gathered) logits."""
    state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        config = _config(save_dir, model=TP_MODELS[arch]())
        config.parallel.tensor_model_parallel_size = world_size
        parts = _build(config)
        _fill_qkv_biases(parts[0])
        _save(config, parts, iteration=5)
        with torch.no_grad():
            logits = parts[0].eval()(_tp_tokens())
        shard = os.path.join(save_dir, "iter_0000005", f"mp_rank_{rank:02d}", "model.safetensors")
        with safe_open(shard, framework="pt") as handle:
            return json.loads(handle.metadata()["sharding"]), logits
    finally:
        state.destroy_model_parallel()


@pytest.mark.processes
@pytest.mark.parametrize("arch", TP_MODELS)
def test_tensor_parallel_shards_record_sharding_and_merge_for_inference(tmp_path, arch: str) -> None:
    sharding, tp2_logits = run_distributed(_tp_save_worker, 2, str(tmp_path), arch)[1]
    split = {n: s for n, s in sharding.items() if s["tensor_model_parallel"]}
    assert split, "TP=2 must shard some params"
    assert all(s["tp_rank"] == 1 and s["tp_size"] == 2 for s in split.values())
    model, config = load_model_for_inference(str(tmp_path), device="cpu")
    assert config.parallel.tensor_model_parallel_size == 1
    for name, info in split.items():
        assert list(dict(model.named_parameters())[name].shape) == info["global_shape"]
    # the merged weights are the TP=1 model built from the same seed
    if arch == "llama_qkv_bias":
        assert split["decoder.layers.1.self_attention.linear_qkv.bias"]["partition_dim"] == 0
    reference = GPTModel(TP_MODELS[arch](), VOCAB, init_seed=0)
    _fill_qkv_biases(reference)
    with torch.no_grad():
        logits = model(_tp_tokens())
        torch.testing.assert_close(logits, reference.eval()(_tp_tokens()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, tp2_logits, rtol=1e-5, atol=1e-5)  # the TP=2 model computed the same


def test_ckpt_step_and_no_save_optim(tmp_path) -> None:
    config = _config(str(tmp_path))
    parts = _build(config)
    _save(config, parts, iteration=1, consumed=2)
    _train_steps(*parts, steps=1)
    _save(config, parts, iteration=2, consumed=4)
    older = _config(str(tmp_path), ckpt_step=1)
    assert load_checkpoint(*_build(older), older, VOCAB).consumed_train_samples == 2

    lean_dir = str(tmp_path / "lean")
    lean = _config(lean_dir, no_save_optim=True)
    _save(lean, parts, iteration=3)
    with pytest.raises(CheckpointError, match=r"optimizer.json is missing .*--no-load-optim"):
        load_checkpoint(*_build(lean), lean, VOCAB)
    weights_only = _config(lean_dir, no_load_optim=True)
    assert load_checkpoint(*_build(weights_only), weights_only, VOCAB).iteration == 3


def _files(root) -> dict[str, bytes]:
    """Every file under `root` (relative path -> content)."""
    return {
        os.path.relpath(os.path.join(folder, name), root): pathlib.Path(folder, name).read_bytes()
        for folder, _, names in os.walk(root)
        for name in names
    }


def _tensor_offset(path: str, name: str) -> int:
    """Where tensor `name`'s bytes start in a safetensors file (8-byte header length, JSON header, data)."""
    with open(path, "rb") as handle:
        (header_size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_size))
    return 8 + header_size + header[name]["data_offsets"][0]


def test_metadata_records_the_size_and_hash_of_every_file(tmp_path) -> None:
    config = _config(str(tmp_path))
    iteration_dir = _save(config, _build(config), iteration=1)
    records = ckpt.read_metadata(iteration_dir)["files"]
    written = sorted(name for name in _files(iteration_dir) if name != "metadata.json")
    assert (
        sorted(records)
        == written
        == [
            "mp_rank_00/model.safetensors",
            "mp_rank_00/optimizer.json",
            "rng/rank_00000.json",
            "rng/rank_00000.safetensors",
        ]
    )  # the optimizer never stepped: no optimizer.safetensors
    for name, record in records.items():
        path = os.path.join(iteration_dir, name)
        assert record == {"size": os.path.getsize(path), "hash": hash_file(path)}


@pytest.mark.parametrize("damage", ["16 KiB of 0xFF over the word embedding", "truncated"])
@pytest.mark.parametrize("loader", ["training", "inference", "converter"])
def test_a_damaged_weights_file_is_refused_naming_it(tmp_path, damage: str, loader: str) -> None:
    config = _config(str(tmp_path))
    iteration_dir = _save(config, _build(config), iteration=1)
    weights = os.path.join(iteration_dir, "mp_rank_00", "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as handle:
        if damage == "truncated":
            handle.truncate(size - 1000)
            expected = f"{weights} is corrupt: it has {size - 1000} bytes but the save wrote {size}"
        else:
            assert VOCAB * 32 * 4 == 16 << 10  # the whole fp32 embedding table
            handle.seek(_tensor_offset(weights, "embedding.word_embeddings.weight"))
            handle.write(b"\xff" * (16 << 10))
            expected = f"{weights} is corrupt: its content hash"
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        if loader == "training":
            load_checkpoint(*_build(config), config, VOCAB)
        elif loader == "inference":
            load_model_for_inference(str(tmp_path), device="cpu")
        else:
            convert_checkpoint(str(tmp_path), str(tmp_path / "converted"), target_tp=2)


@pytest.mark.parametrize(
    "name", ["mp_rank_00/optimizer.safetensors", "mp_rank_00/optimizer.json", "rng/rank_00000.safetensors"]
)
def test_every_file_a_resume_reads_is_verified(tmp_path, name: str) -> None:
    config = _config(str(tmp_path))
    parts = _build(config)
    _train_steps(*parts, steps=1)
    path = os.path.join(_save(config, parts, iteration=1), name)
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) - 2)
        handle.write(b"00")  # same size, other bytes
    with pytest.raises(CheckpointError, match=re.escape(f"{path} is corrupt: its content hash")):
        load_checkpoint(*_build(config), config, VOCAB)


def test_checkpoints_saved_without_hashes_load_with_a_warning(tmp_path, caplog) -> None:
    config = _config(str(tmp_path))
    saved = _build(config)
    iteration_dir = _save(config, saved, iteration=1)
    metadata_path = os.path.join(iteration_dir, "metadata.json")
    metadata = ckpt.read_metadata(iteration_dir)
    del metadata["files"]
    with open(metadata_path, "w") as handle:
        json.dump(metadata, handle)
    parts = _build(config, seed=1)
    with caplog.at_level(logging.WARNING, logger="megatron_train.checkpointing"):
        assert load_checkpoint(*parts, config, VOCAB).iteration == 1
    assert f"{metadata_path} records no content hashes" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(saved[0].parameters(), parts[0].parameters(), strict=True))


def test_a_save_never_overwrites_another_runs_iteration(tmp_path) -> None:
    config = _config(str(tmp_path))
    parts = _build(config)
    first = _save(config, parts, iteration=1, consumed=2)
    second = _save(config, parts, iteration=2, consumed=4)
    before = _files(tmp_path)

    def save(iteration: int, loaded_from: str | None) -> str:
        progress = ckpt.TrainingProgress(iteration, 10 * iteration, 0, loaded_from)
        return save_checkpoint(iteration, parts[0], parts[1], parts[2], progress, config, VOCAB)

    # a fresh run (or --finetune, or one resumed from another folder) refuses, naming the folder
    for loaded_from in (None, str(tmp_path / "elsewhere" / "iter_0000001")):
        with pytest.raises(
            CheckpointError, match=f"{second} already holds a complete checkpoint of another run"
        ):
            save(2, loaded_from)
    # re-saving the iteration this run resumed from leaves it as it is
    assert save(1, first) == first
    assert _files(tmp_path) == before
    # a run resumed from iteration 1 of this folder replaces iteration 2: its own history (a rewind)
    save(2, first)
    assert ckpt.read_metadata(second)["consumed_train_samples"] == 20
    assert read_latest_iteration(str(tmp_path)) == 2
    # an unfinished save (no metadata.json) is removed and written again, leftovers and all
    unfinished = tmp_path / "iter_0000003"
    (unfinished / "mp_rank_01").mkdir(parents=True)
    (unfinished / "mp_rank_01" / "model.safetensors").write_bytes(b"old layout")
    save(3, None)
    assert sorted(os.listdir(unfinished)) == ["metadata.json", "mp_rank_00", "rng"]


def test_a_resume_records_where_it_came_from(tmp_path) -> None:
    config = _config(str(tmp_path))
    iteration_dir = _save(config, _build(config), iteration=1)
    assert load_checkpoint(*_build(config), config, VOCAB).loaded_from == iteration_dir
    finetune = _config(str(tmp_path), finetune=True)
    assert load_checkpoint(*_build(finetune), finetune, VOCAB).loaded_from is None  # a new run


TRAIN = ("--mock-data", "--train-iters", "4", "--save-interval", "2")


def _rerun_without_marker_worker(rank: int, world_size: int, save: str) -> tuple[dict, dict, list[str]]:
    """Train to iteration 4 (saves at 2 and 4), delete the marker, then rerun with --load/--save on the same
    folder, and with a mistyped --load; returns the files before and after, and each rerun's error."""
    from megatron_train.pretrain_gpt import main

    main(tiny_args(save, *TRAIN))
    os.remove(os.path.join(save, "latest_checkpointed_iteration.txt"))
    before = {name: data for name, data in _files(save).items() if name.startswith("iter_")}
    mistyped = tiny_args(save, *TRAIN)
    mistyped[mistyped.index("--load") + 1] = save + "-typo"
    errors = []
    for argv in (tiny_args(save, *TRAIN), mistyped):
        try:
            main(argv)
            errors.append("trained")
        except SystemExit as error:  # the entry point's one line: "pretrain_gpt: <reason>"
            errors.append(str(error))
    after = {name: data for name, data in _files(save).items() if name.startswith("iter_")}
    return before, after, errors


@pytest.mark.processes
def test_a_lost_marker_or_a_mistyped_load_is_an_error_and_touches_no_iteration(tmp_path) -> None:
    save = str(tmp_path / "run")
    before, after, errors = run_distributed(_rerun_without_marker_worker, 1, save, timeout=300)[0]
    assert {name.split("/")[0] for name in before} == {"iter_0000002", "iter_0000004"}
    assert after == before
    assert errors[0].startswith(
        f"pretrain_gpt: {save} holds the checkpoints of iterations [2, 4] but no latest_checkpointed_iteration.txt"
    )
    assert "--ckpt-step 4" in errors[0]
    assert errors[1].startswith(
        f"pretrain_gpt: --load {save}-typo holds no checkpoint but --save {save} holds iterations [2, 4] of another run"
    )


def _save_killed_while_writing(save_dir: str) -> None:
    """Save with a SIGKILL right after the first file's bytes are written, before it is renamed into place."""
    atomic._fsync = lambda path: os.kill(os.getpid(), signal.SIGKILL)
    config = _config(save_dir)
    _save(config, _build(config), iteration=1)


@pytest.mark.processes
def test_a_kill_during_a_save_leaves_only_temporary_files(tmp_path) -> None:
    process = multiprocessing.get_context("fork").Process(
        target=_save_killed_while_writing, args=(str(tmp_path),)
    )
    process.start()
    process.join(60)
    assert process.exitcode == -signal.SIGKILL
    leftovers = list(_files(tmp_path))
    assert leftovers and all(atomic.is_temporary(name) for name in leftovers), leftovers
    assert read_latest_iteration(str(tmp_path)) is None
    config = _config(str(tmp_path))
    _save(config, _build(config), iteration=1)  # the unfinished folder is written again, without leftovers
    assert not any(atomic.is_temporary(name) for name in _files(tmp_path))


def test_write_tensors_hash_taken_in_memory_equals_the_file_hash(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recorded hash comes from the tensors in memory (no re-read); it must be the file's own hash, for
    every dtype, empty and 0-d tensors, and non-contiguous inputs, so verification on load passes."""
    from safetensors.torch import load_file

    from megatron_train.checkpointing.files import write_tensors

    torch.manual_seed(0)
    tensors = {
        "b.bf16": torch.randn(7, 5).to(torch.bfloat16),
        "a.fp32": torch.randn(6, 4).t(),  # non-contiguous
        "c.fp16": torch.randn(3).half(),
        "d.int64": torch.arange(5),
        "e.empty": torch.zeros(0, 3),
        "f.scalar": torch.tensor(2.5),
        "g.bool": torch.tensor([True, False, True]),
    }
    path = str(tmp_path / "model.safetensors")

    def no_reread(path: str) -> str:
        raise AssertionError(f"{path} was read back to hash it")

    monkeypatch.setattr("megatron_train.checkpointing.files.hash_file", no_reread)
    record = write_tensors(path, tensors, {"sharding": "{}"})
    monkeypatch.undo()
    assert record == {"size": os.path.getsize(path), "hash": hash_file(path)}
    loaded = load_file(path)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())
    assert not [name for name in os.listdir(tmp_path) if name != "model.safetensors"]


def test_checkpoint_files_keep_one_metadata_key_so_reruns_write_the_same_bytes(tmp_path):
    """safetensors writes a header's metadata keys in a per-process random order: with two keys the same tensors
    gave other bytes in another process (the pretrain flow's --rebuild byte check failed half the time)."""
    from megatron_train.checkpointing.files import write_tensors

    with pytest.raises(ValueError, match="one safetensors metadata key at most"):
        write_tensors(str(tmp_path / "two.safetensors"), {"w": torch.ones(2)}, {"a": "1", "b": "2"})
