"""Tiny pretraining runs shared by the training tests: Megatron argv for a tiny GPT or BERT, a learnable
.bin/.idx corpus, the run's metrics and checkpoint marker, process-group workers that run an entry point's
`main`, and the SIGKILL-then-resume check of an entry point run as `python -m`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from megatron_train.checkpointing import read_latest_iteration
from storage.indexed_dataset import IndexedDatasetBuilder

ROOT = str(Path(__file__).resolve().parents[2])  # the checkout (cwd and PYTHONPATH of `python -m` runs)
VOCAB = 128
# BERT: the two losses pretrain_bert logs, and the layout flags its tests combine
LOSS_KEYS = ("lm loss", "sop loss")
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
RECOMPUTE = [
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
]


def tiny_args(save: str, *extra: str) -> list[str]:
    return [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--vocab-size", str(VOCAB), "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "3e-3", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.2",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--num-workers", "0",
        "--save", save, "--load", save, "--seed", "7", *extra,
    ]  # fmt: skip


def write_corpus(directory: str, documents: int = 200) -> str:
    """A learnable .bin/.idx: each document counts up by one from a random start (mod 100)."""
    rng = np.random.default_rng(0)
    prefix = os.path.join(directory, "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(documents):
        start, step, length = rng.integers(0, 100), 1, rng.integers(8, 40)
        builder.add_item(np.append((start + step * np.arange(length)) % 100, VOCAB - 1))  # eod = vocab - 1
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def read_metrics(save: str) -> list[dict]:
    with open(os.path.join(save, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def read_marker(save: str) -> int | None:
    return read_latest_iteration(save) if os.path.isdir(save) else None


def train_losses(save: str) -> list[float]:
    return [r["lm loss"] for r in read_metrics(save) if "split" not in r]


def pretrain_worker(rank: int, world_size: int, runs: list[list[str]]) -> list[list[dict]]:
    """Run pretrain_gpt once per argv in this process group; return each run's metrics records."""
    from megatron_train.pretrain_gpt import main

    results = []
    for argv in runs:
        main(argv)
        save = argv[argv.index("--save") + 1]
        results.append(read_metrics(save) if rank == world_size - 1 else [])
    return results


def run_entry_point(module: str, argv: list[str], **popen: object) -> subprocess.Popen:
    """`python -m <module> <argv>` on this checkout, one thread, stdout and stderr merged into `stdout`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.Popen(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen,
    )  # fmt: skip


def sigkill_at_iteration(proc: subprocess.Popen, iteration: int) -> None:
    """SIGKILL a training run as soon as its console logs `iteration`, and wait for it to die so."""
    for line in proc.stdout:
        if line.startswith(f" iteration {iteration:8d}/"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def sigkill_and_resume(
    module: str, argv_for: Callable[..., list[str]], root: Path, iterations: int
) -> tuple[str, list[dict], list[dict]]:
    """Train `module` for `iterations` with dropout on, saving every 2, uninterrupted in `root`/reference; train
    it again in `root`/killed, SIGKILL it at iteration 5 and rerun it to the end with the same argv
    (`argv_for(run dir, *those flags)`). Returns the reference's console output and both runs' training records."""
    flags = ["--train-iters", str(iterations), "--save-interval", "2", "--hidden-dropout", "0.1",
             "--attention-dropout", "0.1"]  # fmt: skip
    reference, killed = str(root / "reference"), str(root / "killed")
    output, _ = run_entry_point(module, argv_for(reference, *flags)).communicate(timeout=300)
    assert read_marker(reference) == iterations, output
    killed_argv = argv_for(killed, *flags)
    sigkill_at_iteration(run_entry_point(module, killed_argv), 5)  # checkpoints at 2 and 4 are on disk
    assert 4 <= read_marker(killed) < iterations
    resumed_output, _ = run_entry_point(module, killed_argv).communicate(timeout=300)
    assert read_marker(killed) == iterations, resumed_output
    return output, *([r for r in read_metrics(run) if "split" not in r] for run in (reference, killed))


def bert_argv(run_dir: str, corpus: tuple[str, str], *extra: str) -> list[str]:
    vocab, data = corpus
    argv = tiny_args(
        run_dir, "--seq-length", "32", "--max-position-embeddings", "32", "--tokenizer-type",
        "BertWordPieceLowerCase", "--vocab-file", vocab, "--make-vocab-size-divisible-by", "64", "--data-path",
        data, "--split", "90,10,0", "--data-cache-path", os.path.join(run_dir, "cache"), "--train-iters", "4",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0", *extra,
    )  # fmt: skip
    vocab_flag = argv.index("--vocab-size")  # GPT's NullTokenizer flag: the WordPiece vocabulary decides
    return argv[:vocab_flag] + argv[vocab_flag + 2 :]


def bert_worker(rank: int, world_size: int, runs: list[list[str]]) -> list[list[dict]]:
    """Run pretrain_bert once per argv in this process group; return each run's training records."""
    from megatron_train.pretrain_bert import main

    results = []
    for argv in runs:
        main(argv)
        save = argv[argv.index("--save") + 1]
        records = read_metrics(save) if rank == world_size - 1 else []
        results.append([r for r in records if "split" not in r])
    return results


def losses(records: list[dict]) -> dict[str, list[float]]:
    return {key: [r[key] for r in records] for key in LOSS_KEYS}
