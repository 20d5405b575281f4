"""--ckpt-format torch_dist: a TP=2 x DP=2 run with the distributed optimizer writes Megatron-Core's distributed
checkpoint from all four ranks, resumes at TP=1 x DP=1 and at PP=2 with the uninterrupted run's losses, and
megatron-core and our converter read it; an async save interrupted by SIGKILL, or a write failing as on a full
disk, leaves the previous checkpoint the one a rerun loads; non-persistent checkpoints; --dist-ckpt-strictness."""

from __future__ import annotations

import os
import re
import signal
import warnings

import numpy as np
import pytest
import torch

from megatron_train.arguments import parse_args
from megatron_train.checkpointing import SavedCheckpoint, read_latest_iteration
from megatron_train.checkpointing.dcp import Destination
from megatron_train.checkpointing.dist_checkpoint import (
    LoadRequests,
    apply_strictness,
    flat_range_boxes,
    shard_blocks,
)
from megatron_train.checkpointing.files import METADATA_FILENAME, CheckpointError
from megatron_train.checkpointing.layout import TensorSharding
from megatron_train.convert import torch_dist
from megatron_train.families.gpt import GPT
from megatron_train.families.registry import get_family
from megatron_train.parallel import state
from megatron_train.training.entry import check_family_config
from tests.helpers.distributed import run_distributed
from tests.helpers.training import (
    pretrain_worker,
    run_entry_point,
    tiny_args,
    train_losses,
    write_corpus,
)

TP2 = ["--tensor-model-parallel-size", "2"]
DIST = ["--ckpt-format", "torch_dist"]


def _argv(run_dir: str, data: str, *extra: str) -> list[str]:
    return tiny_args(
        run_dir, "--data-path", data, "--split", "90,10,0", "--train-iters", "4", "--save-interval", "2",
        "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization",
        *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[str, str]:
    """The uninterrupted TP=2 x DP=2 run (`reference`), and runs resumed from its iteration 2 at TP=1 x DP=1 and
    at PP=2 (their run directories)."""
    tmp = tmp_path_factory.mktemp("dist")
    data = write_corpus(str(tmp))
    dirs = {name: str(tmp / name) for name in ("reference", "tp1", "pp2")}
    run_distributed(
        pretrain_worker, 4, [_argv(dirs["reference"], data, *TP2, "--use-distributed-optimizer", *DIST)]
    )
    for world_size, name, flags in ((1, "tp1", []), (2, "pp2", ["--pipeline-model-parallel-size", "2"])):
        argv = _argv(dirs[name], data, *flags, "--ckpt-step", "2")
        argv[argv.index("--load") + 1] = dirs["reference"]
        run_distributed(pretrain_worker, world_size, [argv])
    return dirs


@pytest.mark.processes
def test_every_rank_writes_its_part(resumed) -> None:
    folder = os.path.join(resumed["reference"], "iter_0000002")
    files = sorted(name for name in os.listdir(folder) if name.endswith(".distcp"))
    assert files == [f"__{rank}_0.distcp" for rank in range(4)]
    # the distributed optimizer: each DP rank wrote its own part of the Adam moments, none is empty
    assert all(os.path.getsize(os.path.join(folder, name)) > 10_000 for name in files)
    assert read_latest_iteration(resumed["reference"]) == 4


@pytest.mark.processes
@pytest.mark.parametrize("name", ["tp1", "pp2"])
def test_resumes_in_another_layout_with_the_uninterrupted_losses(resumed, name) -> None:
    reference = train_losses(resumed["reference"])
    assert len(set(reference)) == 4
    np.testing.assert_allclose(train_losses(resumed[name]), reference[2:], rtol=1e-5)


@pytest.mark.processes
def test_megatron_core_and_the_converter_read_it(resumed) -> None:
    folder = os.path.join(resumed["reference"], "iter_0000004")
    with warnings.catch_warnings():  # megatron-core warns that TransformerEngine and Apex are not installed
        warnings.simplefilter("ignore")
        from megatron.core import dist_checkpointing

        tensors = dist_checkpointing.load_tensors_metadata(folder)
    assert tuple(tensors["decoder.layers.self_attention.linear_qkv.weight"].global_shape) == (2, 96, 32)
    assert tuple(tensors["optimizer.state.exp_avg.embedding.word_embeddings.weight"].global_shape) == (
        256,
        32,
    )
    # our converter reads the training save as Megatron-Core's: the weights the TP=1 run saved in our format
    converted = torch_dist.load(resumed["reference"], 4, true_vocab_size=128, family=GPT).tensors
    ours = SavedCheckpoint(os.path.join(resumed["tp1"], "iter_0000004"))
    for name in ("decoder.layers.1.mlp.linear_fc1.weight", "embedding.word_embeddings.weight"):
        expected = ours.global_tensor(name)[: converted[name].shape[0]]
        torch.testing.assert_close(converted[name], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "shape, start, end", [((6, 5), 3, 27), ((4, 3, 5), 7, 52), ((10,), 2, 9), ((3, 4), 0, 12)]
)
def test_a_flat_range_is_rectangular_boxes_of_consecutive_elements(shape, start, end) -> None:
    flat = torch.arange(int(np.prod(shape))).reshape(shape)
    position = start
    for offsets, sizes in flat_range_boxes(shape, start, end):
        box = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        assert box.reshape(-1).tolist() == list(range(position, position + box.numel()))
        position += box.numel()
    assert position == end


def test_strided_shard_blocks_land_at_their_global_rows() -> None:
    """TP rank 1 of 2 holding [gate_1; up_1] of a [gate; up] fc1 (stride 2): its rows 1..2 (of 4) are global rows
    1 (gate) and 5 (up)."""
    full = torch.arange(8 * 3).reshape(8, 3)
    local = torch.cat([full[2:4], full[6:8]])
    blocks = shard_blocks((4, 3), 3, 9, TensorSharding(0, 2), 2, 1)
    flat = local.reshape(-1)[3:9]
    for block in blocks:
        view = block.take(flat)
        rows, cols = block.offsets
        assert torch.equal(view, full[rows : rows + view.shape[0], cols : cols + view.shape[1]])
    assert [block.offsets for block in blocks] == [(3, 0), (6, 0)]


def _strictness_worker(rank: int, world_size: int) -> dict[str, str]:
    state.initialize_model_parallel()
    try:
        outcomes = {}
        for mode in ("assume_ok_unexpected", "ignore_all", "raise_unexpected", "log_all"):
            shapes = {"decoder.layers.mlp.linear_fc1.weight": (2, 4, 4), "embedding.extra.weight": (4,)}
            requests = LoadRequests(
                [Destination(key, (0, 0, 0), torch.zeros(1, 4, 4)) for key in
                 ("decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight")], {}, {},
            )  # fmt: skip
            try:
                apply_strictness(requests, shapes, False, mode, "ckpt")
                outcomes[mode] = f"loads {[d.key for d in requests.destinations]}"
            except CheckpointError as error:
                outcomes[mode] = str(error)
        return outcomes
    finally:
        state.destroy_model_parallel()


@pytest.mark.processes
def test_dist_ckpt_strictness_decides_what_a_key_mismatch_does() -> None:
    (outcomes,) = run_distributed(_strictness_worker, 1)
    assert "linear_fc2.weight'] (1 keys this run loads are missing)" in outcomes["assume_ok_unexpected"]
    assert outcomes["ignore_all"] == "loads ['decoder.layers.mlp.linear_fc1.weight']"
    assert "does not load: ['embedding.extra.weight']" in outcomes["raise_unexpected"]
    assert outcomes["log_all"] == "loads ['decoder.layers.mlp.linear_fc1.weight']"


# -- faults: a kill during an async save, a full disk ------------------------------------------------------------


def _single_process_argv(run_dir: str, data: str, *extra: str) -> list[str]:
    return _argv(run_dir, data, "--train-iters", "6", *DIST, *extra)


def _logged_losses(output: str) -> dict[int, float]:
    return {
        int(i): float(loss)
        for i, loss in re.findall(r" iteration +(\d+)/ +\d+ \|.*?lm loss: ([0-9.E+-]+)", output)
    }


@pytest.mark.processes
def test_sigkill_during_an_async_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    data = write_corpus(str(tmp_path))
    run_dir = str(tmp_path / "run")
    monkeypatch.setenv("FAULT", "slow")
    monkeypatch.setenv("FAULT_ITERATION", "4")
    monkeypatch.setenv("FAULT_SECONDS", "600")
    argv = _single_process_argv(run_dir, data, "--async-save")
    proc = run_entry_point("tests.helpers.checkpoint_faults", argv)
    output = []
    for line in proc.stdout:
        output.append(line)
        if line.startswith(
            " iteration        5/"
        ):  # training went on while iteration 4's save is being written
            proc.send_signal(signal.SIGKILL)
            break
    proc.communicate(timeout=60)
    killed = "".join(output)
    assert proc.returncode == -signal.SIGKILL and "slow write of" in killed, killed
    assert read_latest_iteration(run_dir) == 2
    assert not os.path.exists(os.path.join(run_dir, "iter_0000004", METADATA_FILENAME))
    monkeypatch.delenv("FAULT")
    resumed, _ = run_entry_point("megatron_train.pretrain_gpt", argv).communicate(timeout=300)
    assert "loaded checkpoint" in resumed and read_latest_iteration(run_dir) == 6, resumed
    before, after = _logged_losses(killed), _logged_losses(resumed)
    assert sorted(after) == [3, 4, 5, 6]
    np.testing.assert_allclose([after[3], after[4], after[5]], [before[3], before[4], before[5]], rtol=1e-5)


@pytest.mark.processes
def test_a_write_that_fails_as_on_a_full_disk_ends_in_one_line_and_keeps_the_last_checkpoint(
    tmp_path, monkeypatch
) -> None:
    data = write_corpus(str(tmp_path))
    run_dir = str(tmp_path / "run")
    monkeypatch.setenv("FAULT", "full")
    monkeypatch.setenv("FAULT_ITERATION", "4")
    output, _ = run_entry_point(
        "tests.helpers.checkpoint_faults", _single_process_argv(run_dir, data)
    ).communicate(timeout=300)
    last = output.strip().splitlines()[-1]
    assert last.startswith("pretrain_gpt: could not write checkpoint") and "File too large" in last, output
    assert "Traceback" not in output
    assert read_latest_iteration(run_dir) == 2
    assert not os.path.exists(os.path.join(run_dir, "iter_0000004", METADATA_FILENAME))


@pytest.mark.processes
def test_non_persistent_checkpoints_keep_the_newest_and_a_resume_takes_the_newer(
    tmp_path, monkeypatch
) -> None:
    """Saves every step to <save>/non_persistent (iteration 4 under --save). SIGKILLed while iteration 6's write
    hangs (tests.helpers.checkpoint_faults): the cleanup before that save removed 3 but kept 5, the newest complete
    one, and the rerun resumes from 5, newer than --save's 4, past the half-written 6."""
    data = write_corpus(str(tmp_path))
    run_dir = str(tmp_path / "run")
    monkeypatch.setenv("FAULT", "slow")
    monkeypatch.setenv("FAULT_ITERATION", "6")
    monkeypatch.setenv("FAULT_SECONDS", "600")
    argv = _single_process_argv(run_dir, data, "--save-interval", "4", "--non-persistent-save-interval", "1")
    proc = run_entry_point("tests.helpers.checkpoint_faults", argv)
    for line in proc.stdout:
        if line.startswith("slow write of") and line.rstrip().endswith("iter_0000006 started"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    transient = os.path.join(run_dir, "non_persistent")
    assert (read_latest_iteration(run_dir), read_latest_iteration(transient)) == (4, 5)
    assert [name for name in sorted(os.listdir(transient)) if name != "iter_0000006"] == [
        "iter_0000005",
        "latest_checkpointed_iteration.txt",
    ]
    assert not os.path.exists(os.path.join(transient, "iter_0000006", METADATA_FILENAME))
    monkeypatch.delenv("FAULT")
    resumed, _ = run_entry_point("megatron_train.pretrain_gpt", argv).communicate(timeout=300)
    assert sorted(_logged_losses(resumed)) == [6], resumed
    assert read_latest_iteration(transient) == 6


def test_families_without_megatron_core_names_refuse_torch_dist_saves(tmp_path) -> None:
    config = parse_args(tiny_args(str(tmp_path), "--train-iters", "2", "--ckpt-format", "torch_dist"))
    check_family_config(get_family("gpt"), config)
    for name, reason in (("hybrid", "Mamba mixers' in-projection"), ("t5", "no Megatron-LM names")):
        with pytest.raises(ValueError, match=f"--ckpt-format torch_dist: the {name} family .*{reason}"):
            check_family_config(get_family(name), config)
