"""The training loop end to end on tiny GPTs: Megatron's flags and console lines, metrics/TensorBoard files,
micro-batching and ramp-up, FLOPs, loss falling on a real .bin/.idx, bitwise reproducibility, resume after
--exit-interval and after SIGKILL, gradient accumulation, bf16, fp16 overflow skipping."""

from __future__ import annotations

import functools
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_train.arguments import (
    MegatronConfig,
    config_from_dict,
    config_to_argv,
    config_to_dict,
    parse_args,
)
from megatron_train.data.config import DataConfig
from megatron_train.families.gpt import gpt_terms
from megatron_train.models.config import TransformerConfig
from megatron_train.training.flops import peak_flops_per_device
from megatron_train.training.logging import format_evaluation_line, format_training_line
from megatron_train.training.microbatches import MicroBatchCalculator
from tests.helpers.distributed import run_distributed
from tests.helpers.training import (
    pretrain_worker,
    read_marker,
    read_metrics,
    run_entry_point,
    sigkill_at_iteration,
    tiny_args,
    train_losses,
    write_corpus,
)

LINE = re.compile(
    r"^ iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| elapsed time per iteration \(ms\): [\d.]+ \|"
    r" throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| learning rate: \d\.\d{6}E[+-]\d\d \|"
    r" global batch size: +(\d+) \| lm loss: \d\.\d{6}E[+-]\d\d \| loss scale: [\d.]+ \| grad norm: [\d.]+ \|"
    r" number of skipped iterations: +\d+ \| number of nan iterations: +\d+ \| tokens per second: [\d.]+ \|"
    r" MFU: n/a \| peak memory \(MB\): [\d.]+ \|$"
)


def test_microbatch_calculator_and_rampup() -> None:
    constant = MicroBatchCalculator(global_batch_size=16, micro_batch_size=2, data_parallel_size=2)
    assert (constant.num_micro_batches, constant.current_global_batch_size) == (4, 16)
    ramp = MicroBatchCalculator(16, 2, 1, rampup_batch_size=[4, 4, 40])  # 3 increments, every 13.3 samples
    sizes = []
    for consumed in (0, 13, 14, 27, 30, 40, 41):
        ramp.update(consumed)
        sizes.append((ramp.current_global_batch_size, ramp.num_micro_batches))
    assert sizes == [(4, 2), (4, 2), (8, 4), (12, 6), (12, 6), (16, 8), (16, 8)]
    # Megatron's update_train_iters: 4+4+4+4+8+8+12 = 44 samples in 7 ramp steps, then (200-44)//16 = 9
    assert ramp.train_iters_for_samples(200) == 16
    with pytest.raises(
        ValueError, match=r"\(10\) must be a multiple of --micro-batch-size x data-parallel size \(4\)"
    ):
        MicroBatchCalculator(10, 2, 2)
    with pytest.raises(ValueError, match="multiple of the increment"):
        MicroBatchCalculator(16, 2, 1, rampup_batch_size=[4, 5, 40])


def test_arguments_are_megatron_flags(tmp_path) -> None:
    config = parse_args(tiny_args(str(tmp_path), "--fp16", "--disable-bias-linear", "--train-iters", "5"), 2)
    assert config.model.fp16 and not config.model.add_bias_linear
    assert not hasattr(config.training, "fp16")  # precision lives in the model config only
    assert (config.training.global_batch_size, config.optimizer.lr_decay_style) == (4, "cosine")
    assert parse_args(config_to_argv(config), 2) == config
    stored = config_to_dict(config)
    stored["model"]["a_flag_from_a_newer_version"] = 1
    del stored["optimizer"]["adam_eps"]
    restored = config_from_dict(json.loads(json.dumps(stored)))
    assert restored.model == config.model and restored.optimizer.adam_eps == 1e-8
    with pytest.raises(SystemExit):
        parse_args(tiny_args(str(tmp_path), "--train-iters", "5", "--micro-batch-size", "3"), 1)
    for extra, _ in (
        (["--train-iters", "5", "--train-samples", "20"], "exactly one"),
        (["--train-iters", "5", "--rampup-batch-size", "2", "2", "10"], "--train-samples"),
        (["--train-iters", "5", "--fp16", "--bf16"], "exclude"),
        (["--train-iters", "5", "--no-such-flag"], "unrecognized"),
    ):
        with pytest.raises(SystemExit):
            parse_args(tiny_args(str(tmp_path), *extra), 1)


def test_model_flops_match_the_megatron_paper() -> None:
    """For a GPT with ffn = 4h: 72 B s L h^2 (1 + s / 6h + V / 12 L h) (Narayanan et al. 2021)."""
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32)
    b, s, L, h, V = 8, 32, 4, 64, 512
    expected = 72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    terms = gpt_terms(MegatronConfig(model=config, data=DataConfig()), V)
    assert b * terms.flops_per_sample() == pytest.approx(expected)
    assert peak_flops_per_device(100.0) == 1e14
    assert peak_flops_per_device(None) is None  # CPU: MFU prints n/a


def test_console_line_keeps_megatron_shape() -> None:
    stats = {
        "iteration": 10, "consumed samples": 80, "elapsed time per iteration (ms)": 123.4,
        "throughput per GPU (TFLOP/s/GPU)": 1.5, "learning rate": 1e-4, "global batch size": 8,
        "lm loss": 5.123456, "loss scale": 1.0, "grad norm": 0.8123, "number of skipped iterations": 0,
        "number of nan iterations": 0, "tokens per second": 100.0, "MFU": None, "peak memory (MB)": 10.0,
    }  # fmt: skip
    line = format_training_line(stats, 100)
    assert line.startswith(" iteration       10/     100 | consumed samples:           80 |")
    assert (
        "| learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 5.123456E+00 | loss scale: 1.0 |"
        in line
    )
    assert "| grad norm: 0.812 | number of skipped iterations:   0 | number of nan iterations:   0 |" in line
    assert LINE.match(line)


def test_console_lines_carry_every_loss_of_the_loss_dict() -> None:
    stats = {
        "iteration": 1, "consumed samples": 8, "elapsed time per iteration (ms)": 1.0,
        "throughput per GPU (TFLOP/s/GPU)": 1.0, "learning rate": 1e-4, "global batch size": 8, "lm loss": 2.5,
        "sop loss": 0.5, "loss scale": 1.0, "grad norm": 1.0, "number of skipped iterations": 0,
        "number of nan iterations": 0, "tokens per second": 1.0, "MFU": None, "peak memory (MB)": 1.0,
    }  # fmt: skip
    line = format_training_line(stats, 10, ["lm loss", "sop loss"])
    assert "| global batch size:     8 | lm loss: 2.500000E+00 | sop loss: 5.000000E-01 | loss scale:" in line
    assert format_evaluation_line("iteration 5", {"lm loss": 1.0, "sop loss": 0.0}) == (
        " validation loss at iteration 5 | lm loss value: 1.000000E+00 | lm loss PPL: 2.718282E+00 |"
        " sop loss value: 0.000000E+00 | sop loss PPL: 1.000000E+00 |"
    )


def two_losses_worker(rank: int, world_size: int, argv: list[str]) -> list[dict]:
    """`pretrain` with GPT's loss_func plus a second entry, `half loss`, in its dict (as BERT adds `sop loss`)."""
    from megatron_train.families import gpt
    from megatron_train.tokenizer import tokenizer_from_config
    from megatron_train.training.entry import padded_vocab_size_for
    from megatron_train.training.loop import pretrain

    def forward_step(data_iterator, model):
        output_tensor, loss_func = gpt.forward_step(data_iterator, model)

        def two_losses(output: torch.Tensor):
            loss, reduced = loss_func(output)
            return loss, {**reduced, "half loss": reduced["lm loss"] / 2}

        return output_tensor, two_losses

    config = parse_args(argv, world_size)
    tokenizer = tokenizer_from_config(config.tokenizer)
    padded_vocab_size = padded_vocab_size_for(config, tokenizer)
    pretrain(
        config,
        gpt.GPT.model_provider,
        functools.partial(gpt.datasets_provider, config, tokenizer),
        forward_step,
        padded_vocab_size,
        gpt.gpt_terms(config, padded_vocab_size),
    )
    return read_metrics(argv[argv.index("--save") + 1]) if rank == world_size - 1 else []


@pytest.mark.processes
def test_loop_averages_and_logs_every_key_of_the_loss_dict(tmp_path) -> None:
    argv = tiny_args(
        str(tmp_path), "--mock-data", "--train-iters", "3", "--eval-interval", "2", "--micro-batch-size", "1"
    )
    records = run_distributed(two_losses_worker, 2, argv)[-1]  # DP=2, 2 micro-batches per rank
    steps = [r for r in records if "split" not in r]
    assert len(steps) == 3
    for record in steps:
        assert record["half loss"] == pytest.approx(record["lm loss"] / 2, rel=1e-6)
    evaluations = [r for r in records if "split" in r]
    assert len(evaluations) == 3  # at iteration 2, then valid and test at the end
    for record in evaluations:
        assert record["half loss"] == pytest.approx(record["lm loss"] / 2, rel=1e-6)
        assert record["half loss PPL"] == pytest.approx(math.exp(record["lm loss"] / 2), rel=1e-6)


def _cli(argv: list[str], **popen: object) -> subprocess.Popen:
    return run_entry_point("megatron_train.pretrain_gpt", argv, **popen)


@pytest.mark.processes
def test_cli_mock_data_end_to_end_then_sigkill_and_resume(tmp_path) -> None:
    """`python -m megatron_train.pretrain_gpt --mock-data`: console lines, metrics, TensorBoard, checkpoints;
    a copy killed with SIGKILL mid-run and resumed with --load logs exactly the same losses."""
    reference = str(tmp_path / "reference")
    argv = ["--mock-data", "--train-iters", "10", "--save-interval", "2", "--hidden-dropout", "0.1"]
    proc = _cli([*tiny_args(reference, *argv), "--tensorboard-dir", str(tmp_path / "tb")])
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    lines = [line for line in output.splitlines() if line.startswith(" iteration")]
    assert [LINE.match(line).group(1, 2, 3, 4) for line in lines] == [
        (str(i), "10", str(4 * i), "4") for i in range(1, 11)
    ]
    assert "validation loss at the end of training for test data |" in output
    records = [r for r in read_metrics(reference) if "split" not in r]
    assert [r["iteration"] for r in records] == list(range(1, 11))
    assert {"lm loss", "learning rate", "grad norm", "tokens per second", "loss scale"} <= set(records[0])
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert read_marker(reference) == 10

    killed = str(tmp_path / "killed")
    sigkill_at_iteration(_cli(tiny_args(killed, *argv)), 5)  # checkpoints at 2 and 4 are on disk
    assert 4 <= read_marker(killed) < 10
    proc = _cli(tiny_args(killed, *argv))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert train_losses(killed) == train_losses(reference)  # bitwise: JSON keeps every bit of a float


def test_signal_handler_records_sigterm_and_restores_the_old_handler() -> None:
    from megatron_train.training.signals import DistributedSignalHandler

    before = signal.getsignal(signal.SIGTERM)
    with DistributedSignalHandler() as handler:
        assert not handler.signals_received()
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.signals_received()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.processes
def test_a_group_of_one_leaves_the_environment_to_the_processes_it_starts() -> None:
    """A plain `python -m` run (or a tool called in-process) joins a one-rank group on a free port without
    setting RANK / MASTER_PORT: set, they sent every process started afterwards to that port (EADDRINUSE)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    code = (
        "import os, torch.distributed as dist\n"
        "from megatron_train.training.setup import initialize_distributed\n"
        "assert initialize_distributed(1) and dist.get_world_size() == 1\n"
        "print(sorted(k for k in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT') if k in os.environ))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.processes
def test_sigterm_with_exit_signal_handler_saves_and_exits(tmp_path) -> None:
    save = str(tmp_path / "run")
    argv = ["--data-path", write_corpus(str(tmp_path)), "--split", "90,10,0", "--train-iters", "100000",
            "--exit-signal-handler"]  # fmt: skip
    proc = _cli(tiny_args(save, *argv))
    output = []
    for line in proc.stdout:
        output.append(line)
        if line.startswith(" iteration        3/"):
            proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert proc.returncode == 0, "".join(output)
    stopped = [line for line in output if "exiting program at iteration" in line]
    assert len(stopped) == 1 and "received SIGTERM" in stopped[0]
    iteration = int(re.search(r"iteration (\d+)", stopped[0]).group(1))
    assert iteration >= 3 and read_marker(save) == iteration


@pytest.fixture(scope="module")
def single_process_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every one-process pretraining run of this module, in one spawned worker (a process pays ~5 s of
    torch start-up): name -> metrics records."""
    tmp = tmp_path_factory.mktemp("runs")
    data = ["--data-path", write_corpus(str(tmp)), "--split", "90,10,0"]
    quiet = ["--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "8"]
    runs = {
        "falls": [*data, *quiet, "--train-iters", "40", "--lr", "1e-2", "--eval-interval", "20", "--eval-iters", "2"],
        "first": [*data, *dropout],
        "second": [*data, *dropout],
        "split": [*data, *dropout, "--exit-interval", "3"],
        "split-resumed": [*data, *dropout],
        "accumulate": [*data, *quiet, "--train-iters", "4"],  # 2 micro-batches of 2
        "big": [*data, *quiet, "--train-iters", "4", "--micro-batch-size", "4"],
        "bf16": [*data, *quiet, "--train-iters", "4", "--bf16"],
        # 2^24 overflows fp16 grads: the scale halves per step (hysteresis 1) until they fit; those steps skip
        # --rampup-batch-size 2 2 8: batches of 2 until 8 samples are consumed, then 4 (Megatron's ramp)
        "rampup": [*data, *quiet, "--train-samples", "40", "--rampup-batch-size", "2", "2", "8"],
        "duration": [*data, *quiet, "--train-iters", "5", "--exit-duration-in-mins", "0"],
        "fp16": [*data, *quiet, "--fp16", "--initial-loss-scale", "16777216", "--hysteresis", "1",
                 "--train-iters", "12"],
    }  # fmt: skip
    save_dirs = {name: str(tmp / name.removesuffix("-resumed")) for name in runs}
    argvs = [tiny_args(save_dirs[name], *extra) for name, extra in runs.items()]
    results = run_distributed(pretrain_worker, 1, argvs)[0]
    return {**dict(zip(runs, results, strict=True)), **{f"{name}-dir": save_dirs[name] for name in runs}}


def _train(records: list[dict]) -> list[float]:
    return [r["lm loss"] for r in records if "split" not in r]


@pytest.mark.processes
def test_loss_falls_on_a_real_bin_idx(single_process_runs) -> None:
    records = single_process_runs["falls"]
    losses = _train(records)
    valid = [r["lm loss"] for r in records if r.get("split") == "valid"]
    assert len(losses) == 40 and len(valid) == 3
    assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:5])
    assert valid[-1] < losses[0]


@pytest.mark.processes
def test_reproducible_and_exit_interval_resume_is_bitwise(single_process_runs) -> None:
    reference = _train(single_process_runs["first"])
    assert len(reference) == 8 and len(set(reference)) == 8
    assert _train(single_process_runs["second"]) == reference
    assert _train(single_process_runs["split"]) == reference[:3]  # stopped by --exit-interval 3
    assert _train(single_process_runs["split-resumed"]) == reference  # the file holds the whole history
    # --exit-duration-in-mins 0: the first step already exceeds it; save and stop
    assert [r["iteration"] for r in single_process_runs["duration"] if "split" not in r] == [1]
    assert read_marker(single_process_runs["duration-dir"]) == 1
    assert os.path.isdir(os.path.join(single_process_runs["split-dir"], "iter_0000003"))
    assert read_marker(single_process_runs["split-dir"]) == 8


@pytest.mark.processes
def test_grad_accumulation_equals_one_big_micro_batch(single_process_runs) -> None:
    accumulate, big = _train(single_process_runs["accumulate"]), _train(single_process_runs["big"])
    np.testing.assert_allclose(accumulate, big, rtol=1e-5)
    assert len(accumulate) == 4 and accumulate[0] != accumulate[-1]


@pytest.mark.processes
def test_bf16_trains_and_fp16_skips_overflowing_steps(single_process_runs) -> None:
    bf16 = _train(single_process_runs["bf16"])
    assert len(bf16) == 4 and all(np.isfinite(bf16))
    steps = [r for r in single_process_runs["fp16"] if "split" not in r]
    skipped = [r["number of skipped iterations"] for r in steps]
    scales = [r["loss scale"] for r in steps]
    assert skipped[:3] == [1, 1, 1] and skipped[-1] == 0
    assert scales == sorted(scales, reverse=True) and scales[-1] < 2**24
    # a skipped step logs no loss (no iteration advanced), as in Megatron; the others are finite
    assert [r["lm loss"] is None for r in steps] == [bool(s) for s in skipped]
    assert all(np.isfinite(r["lm loss"]) for r in steps if r["lm loss"] is not None)


class _OrchestratorCrash(Exception):
    pass


@pytest.mark.processes
def test_pretrain_stage_resumes_after_a_crash_then_hits_the_cache(tmp_path, monkeypatch) -> None:
    """Killed after a checkpoint: the rerun trains from it; killed while moving the finished run into the
    artifact: the rerun finishes the move without training."""
    from stages import pretrain as stage
    from storage.artifacts import ArtifactStore, ArtifactWriter, run_stage

    store = ArtifactStore(str(tmp_path / "store"))

    def tokenized_corpus(writer) -> dict:  # what the tokenize stage commits: <prefix>.bin/.idx + outputs
        prefix = write_corpus(writer.local_dir)
        for ext in ("bin", "idx"):
            writer.put_file(f"{prefix}.{ext}", f"corpus_text_document.{ext}")
        return {"outputs": {"text": "corpus_text_document"}}

    tokenized = run_stage(store, "tokenize", "test", {"corpus": "counting"}, [], tokenized_corpus)
    config = parse_args(tiny_args("ignored", "--mock-data", "--train-iters", "10", "--split", "90,10,0"), 1)
    params = stage.PretrainParams(config=config, save_interval=2)

    def crash_after_first_checkpoint(line: str) -> None:
        if "saved checkpoint at iteration 2" in line:
            raise _OrchestratorCrash

    with pytest.raises(_OrchestratorCrash):
        stage.run(params, [tokenized], store, on_line=crash_after_first_checkpoint)
    lines: list[str] = []
    put_file, placed = ArtifactWriter.put_file, []

    def put_file_then_crash(writer: ArtifactWriter, local_path: str, name: str) -> None:
        if len(placed) == 3:
            raise _OrchestratorCrash
        put_file(writer, local_path, name)
        placed.append(name)

    with monkeypatch.context() as patch:
        patch.setattr(ArtifactWriter, "put_file", put_file_then_crash)
        with pytest.raises(_OrchestratorCrash):
            stage.run(params, [tokenized], store, on_line=lines.append)
    lines_after_the_move: list[str] = []
    ref = stage.run(params, [tokenized], store, on_line=lines_after_the_move.append)
    assert lines_after_the_move == []  # no training: the journal said what was left to move
    assert not ref.cache_hit
    manifest = ref.manifest()
    resumed_from = manifest["resumed_from"]  # 2, or later if training ran on before the kill landed
    assert resumed_from in (2, 4, 6, 8)
    assert (manifest["iteration"], manifest["consumed_train_samples"]) == (10, 40)
    assert [int(m.group(1)) for m in map(LINE.match, lines) if m] == list(range(resumed_from + 1, 11))
    files = ref.files()
    assert {"latest_checkpointed_iteration.txt", "metrics.jsonl", "iter_0000006/metadata.json"} <= set(files)
    assert any(name.startswith("tensorboard/events.out.tfevents") for name in files)
    run_dir = stage.run_directory(ref)
    assert [r["iteration"] for r in read_metrics(run_dir) if "split" not in r] == list(range(1, 11))
    assert stage.run(params, [tokenized], store).cache_hit

    from megatron_train.checkpointing import load_model_for_inference

    model, loaded_config = load_model_for_inference(run_dir, device="cpu")
    assert loaded_config.model.hidden_size == 32 and not model.training


@pytest.mark.processes
def test_rampup_batch_size_with_train_samples(single_process_runs) -> None:
    steps = [r for r in single_process_runs["rampup"] if "split" not in r]
    # 2+2+2+2+4 = 12 samples in the ramp (it ends once more than 8 are consumed), then (40 - 12) // 4 = 7
    assert [r["global batch size"] for r in steps] == [2, 2, 2, 2, 4] + [4] * 7
    assert [r["consumed samples"] for r in steps][-1] == 40
    assert steps[-1]["learning rate"] == pytest.approx(0.0, abs=1e-12)  # decayed over --train-samples
