"""Megatron-LM's own GPT-3 and Llama-3 example scripts, run unchanged with a stand-in `torchrun` that records the
arguments: our parser takes every flag, and tiny versions (sizes shrunk, every other flag kept) train on gloo."""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import pytest

from megatron_train.arguments import build_parser, parse_args
from megatron_train.checkpointing import read_latest_iteration
from megatron_train.tokenizer.train import train_byte_level_bpe
from storage.indexed_dataset import IndexedDatasetBuilder
from tests.helpers.distributed import run_distributed
from tests.helpers.megatron_examples import example_argv
from tests.helpers.training import pretrain_worker

GPT3 = "train_gpt3_175b_distributed.sh"
LLAMA3 = "train_llama3_8b_h100_fp8.sh"
FP8_FLAGS = ("--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather")


def _value_end(argv: list[str], start: int) -> int:
    end = start + 1
    while end < len(argv) and not argv[end].startswith("--"):
        end += 1
    return end


def without(argv: list[str], *flags: str) -> list[str]:
    """`argv` less each of `flags` and its values."""
    out, i = [], 0
    while i < len(argv):
        end = _value_end(argv, i)
        if argv[i] not in flags:
            out += argv[i:end]
        i = end
    return out


def override(argv: list[str], values: dict[str, str]) -> list[str]:
    """`argv` with the values of the given flags replaced (every flag must already be there)."""
    out, i = [], 0
    missing = set(values) - set(argv)
    assert not missing, f"not in the example: {missing}"
    while i < len(argv):
        end = _value_end(argv, i)
        out += [argv[i], *values[argv[i]].split()] if argv[i] in values else argv[i:end]
        i = end
    return out


@pytest.fixture
def gpt3_argv(tmp_path) -> list[str]:
    return example_argv(
        GPT3, tmp_path, "ckpt", "tb", "gpt2-vocab.json", "gpt2-merges.txt", "data_text_document"
    )


@pytest.fixture
def llama3_argv(tmp_path) -> list[str]:
    return example_argv(LLAMA3, tmp_path, str(tmp_path / "ckpt"), str(tmp_path / "tb"))


def test_parser_takes_every_flag_of_both_examples(gpt3_argv, llama3_argv) -> None:
    parser = build_parser()
    for argv in (gpt3_argv, llama3_argv):
        flags = [word for word in argv if word.startswith("--")]
        assert [flag for flag in flags if flag not in parser._option_string_actions] == []
        parser.parse_args(argv)
    assert len({w for w in gpt3_argv + llama3_argv if w.startswith("--")}) == 84

    gpt3 = parse_args(gpt3_argv, world_size=128)
    assert (gpt3.parallel.tensor_model_parallel_size, gpt3.parallel.pipeline_model_parallel_size) == (8, 16)
    assert gpt3.training.step_batch_size_schedule == [
        "0:16",
        "2.4B:320",
        "4.8B:624",
        "7.2B:928",
        "9.6B:1232",
        "12B:1536",
    ]
    assert (gpt3.training.global_batch_size, gpt3.model.fp16, gpt3.compat.attention_backend) == (
        1536,
        True,
        "auto",
    )

    llama3 = parse_args(without(llama3_argv, *FP8_FLAGS), world_size=8)
    training, model = llama3.training, llama3.model
    assert training.calculate_per_token_loss and training.grad_reduce_in_bf16 and training.manual_gc
    assert not training.accumulate_allreduce_grads_in_fp32  # bf16 grads stay bf16 with --grad-reduce-in-bf16
    assert training.overlap_param_gather and llama3.parallel.use_distributed_optimizer
    assert (training.empty_unused_memory_level, llama3.optimizer.decoupled_lr) == (1, 5.0e-4)
    assert model.apply_layernorm_1p and model.normalization == "RMSNorm"
    assert llama3.logging.profile and (
        llama3.logging.profile_step_start,
        llama3.logging.profile_step_end,
    ) == (4, 6)
    assert (llama3.tokenizer.tiktoken_pattern, llama3.compat.ckpt_format, llama3.data.split) == (
        "v2",
        "torch_dist",
        "'99,1,0'",
    )


@pytest.mark.skipif(
    __import__("torch").cuda.is_available() and __import__("torch").cuda.get_device_capability() >= (8, 9),
    reason="this machine has an FP8 GPU",
)
def test_fp8_flags_are_refused_naming_the_flag(llama3_argv, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(llama3_argv, world_size=8)
    error = capsys.readouterr().err
    assert "--fp8-format asks for FP8 training, which needs an FP8 GPU (compute capability 8.9+" in error
    assert "drop the --fp8-format --fp8-amax-history-len --fp8-amax-compute-algo --fp8-param-gather" in error


def test_accepted_only_flags_log_what_they_mean_here(llama3_argv, caplog) -> None:
    caplog.set_level("INFO", logger="megatron_train.arguments")
    parse_args(without(llama3_argv, *FP8_FLAGS), world_size=8)
    kernels = ["--transformer-impl", "local", "--distributed-backend", "gloo", "--no-masked-softmax-fusion"]
    parse_args([*without(llama3_argv, *FP8_FLAGS), *kernels], world_size=8)
    notes = {record.getMessage().split(":")[0] for record in caplog.records}
    assert {
        "--use-mcore-models",
        "--attention-backend fused",
        "--cross-entropy-loss-fusion",
        "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files",
        "--ckpt-format torch_dist",
        "--context-parallel-size 1",
        "--log-throughput",
        "--transformer-impl local",
        "--distributed-backend gloo",
        "--no-masked-softmax-fusion",
    } <= notes


def _tiny_gpt2_files(directory: Path) -> tuple[str, str, str]:
    """A byte-level BPE vocab/merges and a .bin/.idx of counting documents in its ids."""
    texts = [" ".join(str(i + j) for j in range(40)) for i in range(200)]
    files = train_byte_level_bpe(texts, str(directory), vocab_size=300, min_frequency=1)
    prefix = str(directory / "data_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(4000):  # --split 949,50,1 must leave the test split a few documents
        start = rng.integers(0, 200)
        builder.add_item((start + np.arange(rng.integers(8, 40))) % 256)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return files["vocab_file"], files["merge_file"], prefix


def test_tiny_gpt3_example_trains_on_two_pipeline_stages(tmp_path) -> None:
    vocab, merges, data = _tiny_gpt2_files(tmp_path)
    save = str(tmp_path / "ckpt")
    argv = example_argv(GPT3, tmp_path, save, str(tmp_path / "tb"), vocab, merges, data)
    argv = override(
        argv,
        {
            "--num-layers": "2", "--hidden-size": "32", "--num-attention-heads": "4", "--seq-length": "16",
            "--max-position-embeddings": "16", "--global-batch-size": "4",
            "--step-batch-size-schedule": "0:2 32:4",  # tokens: from 2 samples on, batches of 4
            "--train-iters": "3", "--lr-decay-iters": "3", "--tensor-model-parallel-size": "1",
            "--pipeline-model-parallel-size": "2", "--log-interval": "1", "--save-interval": "2",
            "--eval-interval": "2", "--eval-iters": "1",
        },
    )  # fmt: skip
    # fp16's default first loss scale 2^32 overflows (and skips) the first steps, as in Megatron: start lower.
    extra = ["--num-workers", "0", "--initial-loss-scale", "1024"]
    (records,) = run_distributed(pretrain_worker, 2, [[*argv, *extra]])[-1]
    steps = [r for r in records if "split" not in r]
    assert [(r["iteration"], r["consumed samples"], r["global batch size"]) for r in steps] == [
        (1, 2, 2),
        (2, 6, 4),
        (3, 10, 4),
    ]
    assert all(r["lm loss"] > 0 and r["number of skipped iterations"] == 0 for r in steps)
    assert [r["split"] for r in records if "split" in r] == ["valid", "valid", "test"]
    assert read_latest_iteration(save) == 3


def test_tiny_llama3_example_trains_with_every_flag_but_fp8(tmp_path) -> None:
    save, tensorboard = tmp_path / "ckpt", tmp_path / "tb"
    argv = without(example_argv(LLAMA3, tmp_path, str(save), str(tensorboard)), *FP8_FLAGS)
    argv = override(
        argv,
        {
            "--num-layers": "2", "--hidden-size": "32", "--ffn-hidden-size": "64", "--num-attention-heads": "4",
            "--num-query-groups": "2", "--kv-channels": "8", "--seq-length": "16",
            "--max-position-embeddings": "16", "--global-batch-size": "4", "--train-samples": "12",
            "--lr-decay-samples": "12", "--lr-warmup-samples": "4", "--vocab-size": "128", "--eval-iters": "1",
            "--eval-interval": "2", "--save-interval": "3", "--profile-step-start": "1",
            "--profile-step-end": "2",
            "--num-workers": "0",  # the test harness's ranks are daemonic processes: no loader workers
        },
    )  # fmt: skip
    (records,) = run_distributed(pretrain_worker, 2, [argv])[-1]
    steps = [r for r in records if "split" not in r]
    assert [r["iteration"] for r in steps] == [1, 2, 3]
    assert all(np.isfinite(r["lm loss"]) for r in steps)
    # NullTokenizer's 128 ids + eod (padded to 256 logits, the padding masked out of the softmax): at init the
    # per-token mean loss is about ln(129).
    assert steps[0]["lm loss"] == pytest.approx(np.log(129), rel=0.02)
    assert len(glob.glob(str(tensorboard / "rank0.*.pt.trace.json"))) == 1  # --profile, rank 0 only
