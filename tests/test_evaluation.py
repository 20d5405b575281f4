"""Evaluation: WikiText perplexity (disjoint and overlapping windows), LAMBADA, dataset perplexity, the
lm-eval adapter and the tasks/main.py entry point, checked against direct computations."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_train.evaluation.lambada import evaluate_lambada, load_lambada, split_last_word
from megatron_train.evaluation.lm_eval_adapter import MegatronLMEval
from megatron_train.evaluation.perplexity import (
    IndexedTokens,
    num_windows,
    sum_lm_loss,
    validation_perplexity,
    window,
)
from megatron_train.evaluation.wikitext import evaluate_wikitext, load_wikitext, wikitext_detokenizer
from megatron_train.inference.generation import GenerationParams, generate
from storage.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.helpers.generation import (  # noqa: F401 (one_torch_thread is an autouse fixture)
    CharTokenizer,
    build_tiny_gpt,
    one_torch_thread,
    save_tiny_checkpoint,
)


@pytest.fixture(scope="module")
def model():
    return build_tiny_gpt(max_position_embeddings=32)


@pytest.fixture(scope="module")
def tokenizer():
    return CharTokenizer()


def next_token_losses(model, ids: list[int], vocab_size: int | None = None) -> list[float]:
    """-log p(ids[i + 1] | ids[: i + 1]) from one plain forward, over the first vocab_size logits (default all:
    the model's loss, like Megatron's, normalises over the padded vocabulary)."""
    tensor = torch.tensor([ids])
    logits = model(tensor[:, :-1])[..., :vocab_size].float()
    return F.cross_entropy(logits[0], tensor[0, 1:], reduction="none").tolist()


# ---------------------------------------------------------------------------------------------------------
# Windows


@pytest.mark.parametrize("num_tokens", [2, 9, 17, 40])
@pytest.mark.parametrize("overlapping_eval", [None, 8, 5, 3, 1])
def test_windows_score_every_target_exactly_once(num_tokens, overlapping_eval):
    tokens = list(range(100, 100 + num_tokens))
    scored = []
    for index in range(num_windows(num_tokens, 8, overlapping_eval)):
        ids, mask = window(tokens, index, 8, overlapping_eval, pad_id=0)
        assert ids.shape == (9,) and mask.shape == (8,)
        scored += [int(ids[j + 1]) for j in np.flatnonzero(mask)]
    assert scored == tokens[1:]


def test_wikitext_detokenizer():
    raw = ' = = Early life = = \n He was born in 1 @,@ 900 @-@ 1 @.@ 5 ( approx . ) , it \'s " quoted " text . \n'
    assert (
        wikitext_detokenizer(raw)
        == ' == Early life ==\nHe was born in 1,900-1.5 (approx.), it\'s "quoted" text.\n'
    )
    assert wikitext_detokenizer("the dogs ' bone") == "the dogs' bone"


# ---------------------------------------------------------------------------------------------------------
# WikiText


@pytest.fixture
def wiki_file(tmp_path):
    path = tmp_path / "wiki.test.tokens"
    path.write_text(
        " = Title = \n The cat sat on the mat , and the dog @-@ like fox ran . \n It was 1 @,@ 000 . \n"
    )
    return str(path)


def test_wikitext_single_window_is_exp_of_mean_loss(model, tokenizer, wiki_file):
    tokens, words = load_wikitext(wiki_file, tokenizer)
    assert len(tokens) <= 80  # one window of 80 covers the whole text: a plain forward must agree
    model80 = build_tiny_gpt(max_position_embeddings=128)
    result = evaluate_wikitext(model80, tokenizer, wiki_file, seq_length=80)
    mean_loss = float(np.mean(next_token_losses(model80, tokens)))
    assert result.avg_loss == pytest.approx(mean_loss, rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(mean_loss), rel=1e-5)
    assert words == len(Path(wiki_file).read_text().strip().split(" "))
    assert result.token_ratio == (len(tokens) - 1) / (words - 1)
    assert result.adjusted_ppl == pytest.approx(math.exp(mean_loss * result.token_ratio), rel=1e-5)
    assert result.num_tokenized_tokens == len(tokens)
    assert "adjusted ppl:" in result.megatron_line()


def test_wikitext_disjoint_windows_sum_each_windows_loss(model, tokenizer, wiki_file):
    tokens, _ = load_wikitext(wiki_file, tokenizer)
    expected = sum(
        sum(next_token_losses(model, tokens[start : start + 17])) for start in range(0, len(tokens) - 1, 16)
    )
    result = evaluate_wikitext(model, tokenizer, wiki_file, seq_length=16, micro_batch_size=3)
    assert result.avg_loss == pytest.approx(expected / (len(tokens) - 1), rel=1e-5)


def test_overlapping_eval_one_scores_each_token_with_full_context(model, tokenizer, wiki_file):
    tokens, _ = load_wikitext(wiki_file, tokenizer)
    expected = [next_token_losses(model, tokens[max(0, t - 16) : t + 1])[-1] for t in range(1, len(tokens))]
    total, scored = sum_lm_loss(model, tokens, seq_length=16, overlapping_eval=1, micro_batch_size=16)
    assert scored == len(tokens) - 1
    assert total == pytest.approx(sum(expected), rel=1e-5)


def test_wikitext_too_short(tmp_path, model, tokenizer):
    path = tmp_path / "wiki.test.tokens"
    path.write_text("a")
    with pytest.raises(ValueError, match="wiki.test.tokens"):
        evaluate_wikitext(model, tokenizer, str(path), seq_length=16)


# ---------------------------------------------------------------------------------------------------------
# LAMBADA


class NextIdOracle(torch.nn.Module):
    """Predicts id + 1 after every id: a model whose LAMBADA answers are known in advance."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids=None, labels=None, kv_cache=None):
        return F.one_hot((input_ids + 1) % 128, 128).float()


def write_lambada(tmp_path, texts: list[str]) -> str:
    path = tmp_path / "lambada_test.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(path)


def test_lambada_targets(tokenizer):
    assert split_last_word(tokenizer, "one two abcd", strict=False) == (
        tokenizer.tokenize("one two abc"),
        [10 + 3],
    )
    context, target = split_last_word(tokenizer, "one two  abcd", strict=True)
    assert context == tokenizer.tokenize("one two") and target == tokenizer.tokenize(" abcd")


def test_lambada_accuracy_against_an_oracle(tmp_path, tokenizer):
    # Non-strict: "d" follows "c" (correct); "q" does not follow "z" (wrong). Strict: the target starts with
    # " ", which never follows a letter, so nothing is correct. The long passage is cut to seq_length.
    path = write_lambada(tmp_path, ["the word abcd", "the word xyzq", "long " * 20 + "bcdef"])
    loose = evaluate_lambada(NextIdOracle(), tokenizer, path, seq_length=8)
    assert (loose.correct, loose.total, loose.accuracy) == (2, 3, 2 / 3)
    assert evaluate_lambada(NextIdOracle(), tokenizer, path, seq_length=8, strict=True).correct == 0


@pytest.mark.parametrize("strict", [False, True])
def test_lambada_matches_a_direct_computation(tmp_path, model, tokenizer, strict):
    texts = ["the cat sat on the mat", "hello there world", "a b", "it is what it is"]
    path = write_lambada(tmp_path, texts)
    expected = 0
    for context, target in load_lambada(path, tokenizer, strict):
        logits = model(torch.tensor([context + target])[:, :-1])[0, :, : tokenizer.vocab_size]
        expected += logits[len(context) - 1 :].argmax(-1).tolist() == target
    result = evaluate_lambada(model, tokenizer, path, seq_length=32, strict=strict, micro_batch_size=3)
    assert result.correct == expected and result.total == 4


@pytest.mark.parametrize(
    ("line", "message"),
    [("{not json", 'lambada_test.jsonl:2: expected a JSON object with a "text"'), ('{"t": 1}', ":2:")],
)
def test_lambada_bad_lines_name_the_file_and_line(tmp_path, tokenizer, line, message):
    path = tmp_path / "lambada_test.jsonl"
    path.write_text(json.dumps({"text": "a b c"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_lambada(str(path), tokenizer, strict=False)


# ---------------------------------------------------------------------------------------------------------
# Perplexity of a tokenized dataset


@pytest.fixture
def indexed_prefix(tmp_path):
    prefix = str(tmp_path / "valid_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for length in (5, 1, 30, 12, 7):
        builder.add_item(rng.integers(1, 70, size=length))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize(("start", "stop"), [(0, 55), (3, 9), (5, 6), (4, 40), (50, 70), (7, 7)])
def test_indexed_tokens_slice_across_sequences(indexed_prefix, start, stop):
    dataset = IndexedDataset(indexed_prefix)
    stream = np.concatenate([dataset[i] for i in range(len(dataset))])
    tokens = IndexedTokens(dataset)
    assert len(tokens) == len(stream) == 55
    assert tokens[start:stop].tolist() == stream[start:stop].tolist()


def test_validation_perplexity_equals_the_stream_loss(model, indexed_prefix):
    dataset = IndexedDataset(indexed_prefix)
    stream = np.concatenate([dataset[i] for i in range(len(dataset))]).astype(np.int64).tolist()
    expected = sum(sum(next_token_losses(model, stream[start : start + 17])) for start in range(0, 54, 16))
    result = validation_perplexity(model, indexed_prefix, seq_length=16)
    assert result.num_tokens == 54
    assert result.avg_loss == pytest.approx(expected / 54, rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(expected / 54), rel=1e-5)
    assert validation_perplexity(model, indexed_prefix, seq_length=16, max_tokens=20).num_tokens == 19


# ---------------------------------------------------------------------------------------------------------
# lm-evaluation-harness adapter


def harness_requests(kind: str, arguments: list[tuple]):
    """Real lm_eval Instances when the harness is installed, else objects with the same `.args`."""
    try:
        from lm_eval.api.instance import Instance
    except ImportError:
        return [SimpleNamespace(args=args) for args in arguments]
    return [Instance(kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def test_harness_loglikelihood(model, tokenizer):
    adapter = MegatronLMEval(model, tokenizer, batch_size=2)
    pairs = [("the cat", " sat"), ("hello ", "world"), ("", "abc")]
    results = adapter.loglikelihood(harness_requests("loglikelihood", pairs))
    for (context, continuation), (total, greedy) in zip(pairs, results, strict=True):
        context = context.rstrip() or "<eod>"
        ids = [0] if context == "<eod>" else tokenizer.tokenize(context)
        target = tokenizer.tokenize(continuation if context != pairs[1][0].rstrip() else " " + continuation)
        losses = next_token_losses(model, ids + target, tokenizer.vocab_size)[len(ids) - 1 :]
        assert total == pytest.approx(-sum(losses), rel=1e-5)
        logits = model(torch.tensor([ids + target])[:, :-1])[0, len(ids) - 1 :, : tokenizer.vocab_size]
        assert greedy == (logits.argmax(-1).tolist() == target)


def test_harness_rolling_loglikelihood_spans_windows(model, tokenizer):
    text = "the quick brown fox jumps over the lazy dog"  # 43 tokens: two windows of 32
    tokens = tokenizer.tokenize(text)
    vocab = tokenizer.vocab_size
    expected = -sum(next_token_losses(model, [0] + tokens[:32], vocab)) - sum(
        next_token_losses(model, tokens[31:], vocab)
    )
    result = MegatronLMEval(model, tokenizer).loglikelihood_rolling(
        harness_requests("loglikelihood_rolling", [(text,)])
    )
    assert result[0] == pytest.approx(expected, rel=1e-5)


def test_harness_generate_until(model, tokenizer):
    free = generate(model, tokenizer, ["hello"], GenerationParams(tokens_to_generate=8, top_k=1)).completions[
        0
    ]
    request = ("hello", {"until": [free[3:5]], "max_gen_toks": 8})
    out = MegatronLMEval(model, tokenizer).generate_until(harness_requests("generate_until", [request]))
    assert out == [free[: free.find(free[3:5])]]


# ---------------------------------------------------------------------------------------------------------
# tasks/main.py


@pytest.mark.parametrize("task", ["WIKITEXT103", "LAMBADA", "VALID_PPL"])
def test_tasks_main(monkeypatch, tmp_path, capsys, model, tokenizer, wiki_file, indexed_prefix, task):
    from megatron_train.tasks import main as tasks_main

    config = SimpleNamespace(model=SimpleNamespace(seq_length=16))
    monkeypatch.setattr(tasks_main, "load_for_inference", lambda args, device: (model, tokenizer, config))
    data = {
        "WIKITEXT103": wiki_file,
        "LAMBADA": write_lambada(tmp_path, ["a b c", "x y z"]),
        "VALID_PPL": indexed_prefix,
    }
    results = tmp_path / "results.json"
    metrics = tasks_main.main(
        ["--task", task, "--valid-data", data[task], "--load", "CKPT", "--results-json", str(results)]
        + (["--strict-lambada"] if task == "LAMBADA" else ["--overlapping-eval", "4"])
    )
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == printed[2] == "-" * (len(printed[1]) + 1)
    assert printed[1].startswith(f" validation results on {task} | ")
    assert json.loads(results.read_text()) == metrics
    if task == "WIKITEXT103":
        assert metrics["avg_loss"] == evaluate_wikitext(model, tokenizer, wiki_file, 16, 4).avg_loss
    if task == "LAMBADA":
        assert metrics["total"] == 2 and 0 <= metrics["accuracy"] <= 1


def test_tasks_main_on_a_real_checkpoint(tmp_path, indexed_prefix, capsys):
    from megatron_train.checkpointing import load_model_for_inference
    from megatron_train.tasks import main as tasks_main

    load = save_tiny_checkpoint(str(tmp_path / "ckpt"))
    argv = ["--task", "VALID_PPL", "--valid-data", indexed_prefix, "--load", load, "--seq-length", "16"]
    metrics = tasks_main.main(argv)
    model, _ = load_model_for_inference(load)
    assert metrics["avg_loss"] == pytest.approx(
        validation_perplexity(model, indexed_prefix, 16).avg_loss, rel=1e-6
    )
    assert metrics["num_tokens"] == 54


MEGATRON_FLAGS = [  # what a Megatron training script passes: model shape, parallelism, training-only flags
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--max-position-embeddings", "64",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--lr", "1e-4",
    "--train-iters", "10", "--global-batch-size", "8", "--use-checkpoint-args", "--tokenizer-type",
    "NullTokenizer", "--vocab-size", "100",
]  # fmt: skip


def test_tasks_main_takes_megatron_flags(tmp_path, indexed_prefix):
    from megatron_train.checkpointing import load_model_for_inference
    from megatron_train.tasks import main as tasks_main

    load = save_tiny_checkpoint(str(tmp_path / "ckpt"))
    argv = ["--task", "VALID_PPL", "--valid-data", indexed_prefix, "--load", load, "--seq-length", "16"]
    metrics = tasks_main.main([*argv, *MEGATRON_FLAGS, "--micro-batch-size", "2"])
    model, _ = load_model_for_inference(load)
    expected = validation_perplexity(model, indexed_prefix, 16, micro_batch_size=2)
    assert metrics["avg_loss"] == pytest.approx(expected.avg_loss, rel=1e-6)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--hidden-size", "64"], "--hidden-size (given: hidden_size=64) does not match checkpoint"),
        (["--swiglu"], "--swiglu (given: swiglu=True) does not match checkpoint"),
        (["--vocab-size", "300"], "the tokenizer has 301 tokens but checkpoint"),
    ],
)
def test_tasks_main_refuses_flags_the_checkpoint_contradicts(
    tmp_path, indexed_prefix, capsys, flags, message
):
    from megatron_train.tasks import main as tasks_main

    load = save_tiny_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(SystemExit) as exit_info:
        tasks_main.main(["--task", "VALID_PPL", "--valid-data", indexed_prefix, "--load", load, *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_checkpoint_without_tokenizer_needs_the_flags():
    from megatron_train.inference.checkpoint import tokenizer_for
    from megatron_train.training.config import TokenizerConfig

    config = SimpleNamespace(tokenizer=TokenizerConfig())
    flags = SimpleNamespace()  # no tokenizer flag given
    with pytest.raises(ValueError, match="CKPT: the checkpoint records no tokenizer; pass --tokenizer-type"):
        tokenizer_for(config, flags, "CKPT")
    flags.tokenizer_type, flags.vocab_size = "NullTokenizer", 50
    assert tokenizer_for(config, flags, "CKPT").eod == 50


def test_harness_model_args_load_a_checkpoint_and_its_tokenizer(tmp_path):
    load = save_tiny_checkpoint(str(tmp_path / "ckpt"))
    harness = MegatronLMEval.create_from_arg_string(f"load={load},batch_size=3,vocab_size=99")
    assert harness.batch_size == 3 and harness.tokenizer.vocab_size == 100
    assert MegatronLMEval.create_from_arg_obj({"load": load}, {"batch_size": 2}).tokenizer.vocab_size == 101
    with pytest.raises(ValueError, match="unknown: pretrained"):
        MegatronLMEval.create_from_arg_obj({"load": load, "pretrained": "gpt2"})


@pytest.mark.processes
def test_lm_eval_command_runs_a_local_task(tmp_path):
    """lm-eval's real command line (through our wrapper) on a task file and data of our own: its accuracy is
    the one the adapter's log-likelihoods give."""
    from megatron_train.checkpointing import load_model_for_inference
    from megatron_train.tokenizer import build_tokenizer

    pytest.importorskip("lm_eval")
    load = save_tiny_checkpoint(str(tmp_path / "ckpt"))
    model, _ = load_model_for_inference(load)
    harness = MegatronLMEval(model, build_tokenizer("NullTokenizer", vocab_size=100))
    docs = [("1 2 3", ["4", "9", "50"]), ("7 7", ["7", "1"]), ("10 20 30", ["40", "3"]), ("5 4", ["6", "8"])]
    rows = []
    for index, (context, choices) in enumerate(docs):
        scores = harness.loglikelihood([SimpleNamespace(args=(context, " " + c)) for c in choices])
        best = max(range(len(choices)), key=lambda i: scores[i][0])
        label = best if index < 2 else (best + 1) % len(choices)  # two right, two wrong: accuracy 0.5
        rows.append(json.dumps({"context": context, "choices": choices, "label": label}))
    (tmp_path / "data.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny.yaml").write_text(
        "task: megatron_flow_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'data.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    command = [sys.executable, "-m", "megatron_train.tasks.lm_eval", "--model", "megatron-flow"]
    command += ["--model_args", f"load={load}", "--tasks", "megatron_flow_tiny", "--device", "cpu"]
    command += ["--include_path", str(tmp_path / "tasks"), "--output_path", str(tmp_path / "out")]
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env = {**os.environ, **offline, "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]["megatron_flow_tiny"]
    assert results["acc,none"] == 0.5 and results["sample_len"] == 4


def test_harness_registry_finds_the_adapter():
    registry = pytest.importorskip("lm_eval.api.registry")
    assert registry.get_model("megatron-flow") is MegatronLMEval
