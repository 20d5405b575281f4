"""MegatronPretrainingSampler resumes exactly; the data loader yields the dataset's samples as tensors."""

from __future__ import annotations

import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

from megatron_train.data.builder import build_train_valid_test_datasets
from megatron_train.data.config import DataConfig
from megatron_train.data.samplers import MegatronPretrainingSampler, build_pretraining_data_loader
from tests.helpers.distributed import run_distributed


def megatron_batches(total, consumed, micro_batch_size, rank, world, drop_last=True):
    """Megatron's `MegatronPretrainingSampler.__iter__`, line by line."""
    batch, out = [], []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == micro_batch_size * world:
            out.append(batch[rank * micro_batch_size : (rank + 1) * micro_batch_size])
            batch = []
    if batch and not drop_last:
        out.append(batch[rank * micro_batch_size : (rank + 1) * micro_batch_size])
    return out


class ArangeDataset(torch.utils.data.Dataset):
    """Sample i is a dict of arrays holding i, so a batch shows which samples it holds."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i):
        return {"tokens": np.full(4, i, dtype=np.int64), "loss_mask": np.full(4, i, dtype=np.float32)}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_continues_the_uninterrupted_pass(world, drop_last):
    total, micro_batch_size = 103, 4
    global_batch = micro_batch_size * world
    for rank in range(world):
        full = list(MegatronPretrainingSampler(total, 0, micro_batch_size, rank, world, drop_last))
        assert full == megatron_batches(total, 0, micro_batch_size, rank, world, drop_last)
        assert len(full) == len(
            MegatronPretrainingSampler(total, 0, micro_batch_size, rank, world, drop_last)
        )
        for step in range(0, len(full)):
            consumed = step * global_batch
            resumed = list(
                MegatronPretrainingSampler(total, consumed, micro_batch_size, rank, world, drop_last)
            )
            assert resumed == full[step:]
            assert resumed == megatron_batches(total, consumed, micro_batch_size, rank, world, drop_last)


def test_ranks_split_each_global_batch():
    total, micro_batch_size, world = 64, 3, 2
    per_rank = [list(MegatronPretrainingSampler(total, 6, micro_batch_size, r, world)) for r in range(world)]
    assert len(per_rank[0]) == len(per_rank[1]) == (64 - 6) // 6
    for k, (first, second) in enumerate(zip(*per_rank, strict=True)):
        assert first + second == list(range(6 + 6 * k, 12 + 6 * k))


def test_resume_mid_batch_position():
    """consumed_samples need not be a multiple of the global batch (e.g. after a batch-size ramp-up)."""
    batches = list(MegatronPretrainingSampler(20, 5, 2, 1, 2))
    assert batches == [[7, 8], [11, 12], [15, 16]]


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 0, 1, 0, 1), "no samples"),
        ((10, 10, 1, 0, 1), "consumed_samples 10"),
        ((10, 0, 0, 0, 1), "micro-batch-size"),
        ((10, 0, 1, 2, 2), "rank 2 is not in"),
    ],
)
def test_sampler_errors(args, message):
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingSampler(*args)


def test_data_loader_yields_tensors_in_sampler_order():
    loader = build_pretraining_data_loader(ArangeDataset(), 8, 4, 1, 2)
    batches = list(loader)
    assert len(batches) == len(loader) == (50 - 8) // 8
    assert batches[0]["tokens"].dtype == torch.int64 and batches[0]["loss_mask"].dtype == torch.float32
    for k, batch in enumerate(batches):
        expected = torch.arange(8 + 8 * k + 4, 8 + 8 * k + 8)
        assert torch.equal(batch["tokens"], expected[:, None].expand(4, 4))
    assert build_pretraining_data_loader(None, 0, 4, 0, 1) is None


def first_batch_with_a_worker() -> tuple[dict, list[dict]]:
    """The loader's first batch (one worker process) and the samples 4 and 5 it should hold."""
    train, _, _ = build_train_valid_test_datasets(
        DataConfig(mock_data=True), 32, (16, 0, 0), 3, 0, vocab_size=64
    )
    loader = build_pretraining_data_loader(train, 4, 2, 0, 1, num_workers=1)
    return next(iter(loader)), [train[4], train[5]]


@pytest.mark.processes
def test_data_loader_over_gpt_dataset_with_workers():
    # In a fresh process: a worker forked from the test process, after the Prefect tests, exits with status 1
    # at shutdown (threading._shutdown's assertion in the child, after Prefect's at-fork handlers).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        batch, samples = pool.submit(first_batch_with_a_worker).result(timeout=120)
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert batch["tokens"].shape == (2, 32) and batch["position_ids"].dtype == torch.int64
    for row, sample in enumerate(samples):
        assert torch.equal(batch["tokens"][row], torch.from_numpy(sample["tokens"]))
        assert torch.equal(batch["labels"][row], torch.from_numpy(sample["labels"]))


def build_on_two_ranks(rank, world_size, data_path, cache):
    """Each rank builds the datasets; returns what it logged and the train indices it got."""
    from tests.helpers.gpt_dataset import EOD

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("megatron_train.data.indices")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    config = DataConfig(data_path=[data_path], split="9,1,0", data_cache_path=cache)
    train, _, _ = build_train_valid_test_datasets(config, 16, (40, 4, 0), 1234, EOD)
    return records, np.asarray(train.shuffle_index).tolist()


@pytest.mark.processes
def test_rank_zero_builds_and_other_ranks_load(tmp_path):
    from tests.helpers.gpt_dataset import random_documents, write_dataset

    prefix = write_dataset(
        str(tmp_path / "ddp_text_document"), random_documents(np.random.default_rng(1), 30)
    )
    (logs0, order0), (logs1, order1) = run_distributed(build_on_two_ranks, 2, prefix, str(tmp_path / "cache"))
    assert any("train indices built" in line for line in logs0)
    assert any("train indices loaded from cache" in line for line in logs1)
    assert not any("built" in line for line in logs1)
    assert order0 == order1
