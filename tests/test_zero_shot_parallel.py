"""Zero-shot WikiText-103 and LAMBADA (`tasks.main`) split over ranks: TP2, PP2 and TP2 x PP2, each with
data-parallel replicas, give one process's numbers while every rank holds only its part of the model, read from
our checkpoint or from Megatron-LM's legacy files of the same weights."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_train.checkpointing import load_model_for_inference
from megatron_train.models.gpt import GPTModel
from megatron_train.tasks import main as tasks_main
from megatron_train.tools import checkpoint_util
from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.generation import one_torch_thread, save_tiny_checkpoint  # noqa: F401 (autouse fixture)
from tests.helpers.tiny import tiny_config

pytestmark = pytest.mark.processes  # every test here starts processes

# (TP, PP, checkpoint) on 4 ranks, so TP2 and PP2 also run 2 data-parallel replicas; ours, and Megatron-LM's
# legacy files of the same weights
RUNS = [(2, 1, "flow"), (1, 2, "flow"), (2, 2, "flow"), (2, 2, "torch")]
PARAMETER_LINE = re.compile(
    r" > number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)"
)


def stage_parameters(tp: int, pp: int, pp_rank: int) -> int:
    """What one rank of the tiny GPT (2 layers, hidden 32, ffn 128, 64 learned positions, vocabulary padded to
    128 x TP, tied output layer) holds: its TP slice of its stage's layers, the embedding on the first stage,
    the final norm and the tied output layer's copy on the last."""
    h, ffn, vocab = 32, 128, 128 * tp
    layer = (
        4 * h + (3 * h * h + 3 * h + h * h + h * ffn + ffn + ffn * h) // tp + 2 * h
    )  # norms, splits, row biases
    count = layer * (2 // pp)
    if pp_rank == 0:
        count += vocab * h // tp + 64 * h
    if pp_rank == pp - 1:
        count += 2 * h + (vocab * h // tp if pp > 1 else 0)
    return count


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory) -> dict:
    """A tiny GPT checkpoint (NullTokenizer(100): ids as words) in our format and in Megatron-LM's legacy one,
    WikiText and LAMBADA files, and each task's flags with its single-process metrics."""
    root = tmp_path_factory.mktemp("zero_shot")
    torch.manual_seed(0)  # the tiny GPT, its padding rows (past the tokenizer's 101 ids) recorded as padding
    config = tiny_config(seq_length=64, max_position_embeddings=64, init_method_std=0.2, true_vocab_size=101)
    load = save_tiny_checkpoint(str(root / "ckpt"), GPTModel(config, vocab_size=128).eval())
    checkpoint_util.main(["--loader", "flow", "--saver", "megatron", "--load-dir", load, "--save-dir",
                          str(root / "torch")])  # fmt: skip
    wiki = root / "wiki.test.tokens"
    wiki.write_text(
        "".join(" " + " ".join(str((7 * i + j) % 97) for j in range(23)) + " \n" for i in range(9))
    )
    model, _ = load_model_for_inference(load)
    passages = []  # the model's greedy next word ends the even passages, another word the odd ones
    for i in range(11):
        context = [(i * j + 3) % 90 for j in range(5 + i)]
        greedy = int(model(torch.tensor([context[-12:]]))[0, -1, :100].argmax())  # as --seq-length 12 cuts it
        passages.append(context + [greedy if i % 2 == 0 else (greedy + 1) % 100])
    lambada = root / "lambada_test.jsonl"
    lambada.write_text("".join(json.dumps({"text": " ".join(map(str, ids))}) + "\n" for ids in passages))
    tasks = {
        "WIKITEXT103": ["--valid-data", str(wiki), "--seq-length", "24", "--overlapping-eval", "8"],
        "LAMBADA": ["--valid-data", str(lambada), "--strict-lambada", "--seq-length", "12"],
    }
    argvs = {
        task: ["--task", task, "--load", load, "--micro-batch-size", "3", *flags]
        for task, flags in tasks.items()
    }
    expected = {task: tasks_main.main(argv) for task, argv in argvs.items()}
    return {"argvs": argvs, "expected": expected, "loads": {"flow": load, "torch": str(root / "torch")}}


def _evaluate_in_layouts(rank: int, world_size: int, argvs: dict, loads: dict) -> dict:
    results = {}
    for tp, pp, saved in RUNS:
        for task, argv in argvs.items():
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
                metrics = tasks_main.main([*argv, *layout, "--load", loads[saved]])
            results[(tp, pp, saved, task)] = (metrics, printed.getvalue())
    return results


def check_parameter_lines(printed: str, tp: int, pp: int) -> None:
    counts = {(int(t), int(p)): int(n) for t, p, n in PARAMETER_LINE.findall(printed)}
    assert counts == {(t, p): stage_parameters(tp, pp, p) for t in range(tp) for p in range(pp)}, (tp, pp)


def test_tp_pp_and_dp_evaluate_as_one_process(evaluation):
    expected = evaluation["expected"]
    assert (expected["LAMBADA"]["correct"], expected["LAMBADA"]["total"]) == (6, 11)
    ranks = run_distributed(_evaluate_in_layouts, 4, evaluation["argvs"], evaluation["loads"])
    for run, _ in ranks[0].items():
        tp, pp, saved, task = run
        where = f"{task} at TP={tp} PP={pp} DP={4 // (tp * pp)} from a {saved} checkpoint"
        for metrics, _ in (rank_results[run] for rank_results in ranks):
            numbers = {key: value for key, value in expected[task].items() if not isinstance(value, str)}
            assert {key: metrics[key] for key in numbers} == pytest.approx(numbers, rel=1e-5), where
        check_parameter_lines("".join(rank_results[run][1] for rank_results in ranks), tp, pp)
        result_lines = [rank for rank, results in enumerate(ranks) if "validation results" in results[run][1]]
        assert result_lines == [0], where  # the result is printed once


def test_torchrun_tasks_main_at_tp2_pp2(evaluation, tmp_path):
    results = tmp_path / "results.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
        "-m", "megatron_train.tasks.main", *evaluation["argvs"]["WIKITEXT103"], "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--results-json", str(results),
    ]  # fmt: skip
    run = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert run.returncode == 0, run.stderr[-3000:]
    check_parameter_lines(run.stdout, 2, 2)
    expected = evaluation["expected"]["WIKITEXT103"]
    metrics = json.loads(results.read_text())
    assert metrics["avg_loss"] == pytest.approx(expected["avg_loss"], rel=1e-5)
    assert metrics["num_tokenized_tokens"] == expected["num_tokenized_tokens"]
