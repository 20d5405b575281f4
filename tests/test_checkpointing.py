"""Checkpoints: round trips of weights, optimizer, scheduler and RNG; the latest marker written last;
Megatron's --finetune / --no-load-optim / --no-load-rng; clear refusals of broken or mismatched checkpoints;
TP shards with their sharding info merged back by load_model_for_inference."""

from __future__ import annotations

import json
import os
import random

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
from megatron_train.training.config import CheckpointConfig, OptimizerConfig, TrainingConfig
from megatron_train.training.lr_scheduler import build_opt_param_scheduler
from tests.distributed import run_distributed

VOCAB = 128


def _config(save_dir: str, hidden_size: int = 32, **checkpoint: object) -> MegatronConfig:
    model = TransformerConfig(
        num_layers=2,
        hidden_size=hidden_size,
        num_attention_heads=4,
        seq_length=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return MegatronConfig(
        model=model,
        data=DataConfig(mock_data=True),
        training=TrainingConfig(train_iters=10, global_batch_size=2),
        optimizer=OptimizerConfig(lr=1e-3, lr_warmup_iters=2),
        checkpoint=CheckpointConfig(save=save_dir, load=save_dir, **checkpoint),
    )


def _build(config: MegatronConfig, seed: int = 0):
    model_parallel_seed(seed)
    model = GPTModel(config.model, VOCAB)
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
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_save, "write_metadata", crash_on_metadata)
    with pytest.raises(OSError):
        _save(config, parts, iteration=2)
    monkeypatch.undo()
    assert read_latest_iteration(str(tmp_path)) == 1
    assert load_checkpoint(*_build(config), config, VOCAB).iteration == 1


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


def _tp_save_worker(rank: int, world_size: int, save_dir: str) -> dict:
    state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        config = _config(save_dir)
        config.parallel.tensor_model_parallel_size = world_size
        parts = _build(config)
        _save(config, parts, iteration=5)
        shard = os.path.join(save_dir, "iter_0000005", f"mp_rank_{rank:02d}", "model.safetensors")
        with safe_open(shard, framework="pt") as handle:
            return json.loads(handle.metadata()["sharding"])
    finally:
        state.destroy_model_parallel()


def test_tensor_parallel_shards_record_sharding_and_merge_for_inference(tmp_path) -> None:
    sharding = run_distributed(_tp_save_worker, 2, str(tmp_path))
    split = {n: s for n, s in sharding[1].items() if s["tensor_model_parallel"]}
    assert split, "TP=2 must shard some params"
    assert all(s["tp_rank"] == 1 and s["tp_size"] == 2 for s in split.values())
    model, config = load_model_for_inference(str(tmp_path), device="cpu")
    assert config.parallel.tensor_model_parallel_size == 1
    for name, info in split.items():
        assert list(dict(model.named_parameters())[name].shape) == info["global_shape"]
    # the merged weights are the TP=1 model built from the same seed
    model_parallel_seed(0)
    reference = GPTModel(_config(str(tmp_path)).model, VOCAB)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference.eval()(tokens), rtol=1e-5, atol=1e-5)


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
