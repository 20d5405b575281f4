"""`pretrain_bert` on the training engine: the same losses (`lm loss`, `sop loss`) under TP=2 + SP, DP=2 with
the distributed optimizer, PP=2 and full recompute as in one process; a SIGKILLed run resumes bitwise; a TP=2
checkpoint continues at TP=1; checkpoints record the model type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_train.checkpointing.inference import load_model_for_inference
from megatron_train.inference.checkpoint import build_inference_parser, load_for_inference
from megatron_train.models.bert import BertModel
from tests.helpers.distributed import run_distributed
from tests.helpers.training import (
    LOSS_KEYS,
    PP2,
    RECOMPUTE,
    TP2,
    bert_argv,
    bert_worker,
    losses,
    sigkill_and_resume,
    tiny_args,
)
from tests.helpers.wordpiece_corpus import write_wordpiece_corpus

pytestmark = pytest.mark.processes  # every test here starts processes

LAYOUTS = {  # name: (world size, flags); the 148-token vocabulary pads to 192 rows at TP=1, 256 at TP=2
    "tp1": (1, []),
    "tp1-recompute": (1, RECOMPUTE),
    "tp2-sp": (2, [*TP2, "--sequence-parallel"]),
    "dp2-distributed-optimizer": (2, ["--use-distributed-optimizer"]),
    "pp2": (2, PP2),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """(vocab file, --data-path prefix) of a sentence-split WordPiece corpus."""
    return write_wordpiece_corpus(tmp_path_factory.mktemp("bert-data"), 300)


@pytest.fixture(scope="module")
def layout_records(tmp_path_factory, corpus) -> dict[str, list[dict]]:
    """Training records of every layout and of a run without the binary head, one process group per size."""
    tmp = tmp_path_factory.mktemp("bert-layouts")
    runs_by_name = {**LAYOUTS, "no-binary-head": (1, ["--bert-no-binary-head"])}
    results = {}
    for world_size in sorted({size for size, _ in runs_by_name.values()}):
        names = [name for name, (size, _) in runs_by_name.items() if size == world_size]
        runs = [
            bert_argv(str(tmp / name), corpus, *runs_by_name[name][1], "--use-cpu-initialization")
            for name in names
        ]
        last_rank = run_distributed(bert_worker, world_size, runs, timeout=300)[-1]
        results |= dict(zip(names, last_rank, strict=True))
    return results


@pytest.mark.parametrize("name", [name for name in LAYOUTS if name != "tp1"])
def test_bert_losses_equal_one_process_under_every_layout(layout_records, name) -> None:
    reference = losses(layout_records["tp1"])
    for key in LOSS_KEYS:
        assert len(reference[key]) == 4 and len(set(reference[key])) == 4
        np.testing.assert_allclose(
            losses(layout_records[name])[key], reference[key], rtol=1e-5, err_msg=f"{name} {key}"
        )


def test_bert_no_binary_head_logs_only_the_lm_loss(layout_records) -> None:
    records = layout_records["no-binary-head"]
    assert all("sop loss" not in r and np.isfinite(r["lm loss"]) for r in records) and len(records) == 4


def test_checkpoint_saved_at_tp2_continues_at_tp1_with_tp2s_losses(tmp_path, corpus) -> None:
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    runs = [bert_argv(full, corpus, *TP2), bert_argv(split, corpus, *TP2, "--exit-interval", "2")]
    reference, stopped = run_distributed(bert_worker, 2, runs, timeout=300)[-1]
    assert losses(stopped) == losses(reference[:2])
    (resumed,) = run_distributed(bert_worker, 1, [bert_argv(split, corpus)], timeout=300)[-1]
    for key in LOSS_KEYS:
        np.testing.assert_allclose(losses(resumed[2:])[key], losses(reference[2:])[key], rtol=1e-5)

    model, config = load_model_for_inference(split)
    assert isinstance(model, BertModel) and model.binary_head is not None and config.model.num_layers == 2
    tokens = torch.randint(0, 148, (1, 32))
    logits, binary = model(tokens)
    assert logits.shape == (1, 32, 192) and binary.shape == (1, 2)
    args = build_inference_parser("generation").parse_args(["--load", split])
    with pytest.raises(
        ValueError, match="holds a bert model; generation and language-model evaluation need a GPT"
    ):
        load_for_inference(args)


def gpt_then_bert_worker(rank: int, world_size: int, gpt_argv: list[str], bert_argv: list[str]) -> str:
    from megatron_train.pretrain_bert import main as bert_main
    from megatron_train.pretrain_gpt import main as gpt_main

    gpt_main(gpt_argv)
    with pytest.raises(SystemExit) as error:
        bert_main(bert_argv)
    return str(error.value)


def test_a_gpt_checkpoint_is_refused_by_pretrain_bert(tmp_path, corpus) -> None:
    save = str(tmp_path / "gpt")
    gpt_argv = tiny_args(save, "--mock-data", "--train-iters", "1")
    (message,) = run_distributed(gpt_then_bert_worker, 1, gpt_argv, bert_argv(save, corpus), timeout=300)
    assert message.startswith("pretrain_bert: checkpoint ")
    assert "holds a gpt model but this run trains a bert model: use pretrain_gpt" in message


def failing_runs_worker(rank: int, world_size: int, runs: list[list[str]]) -> list[str]:
    """Each run's SystemExit message: what a user sees instead of a traceback."""
    from megatron_train.pretrain_bert import main

    messages = []
    for argv in runs:
        with pytest.raises(SystemExit) as error:
            main(argv)
        messages.append(str(error.value))
    return messages


def test_a_missing_or_truncated_file_ends_the_run_in_one_line_naming_it(tmp_path, corpus) -> None:
    vocab, data = corpus
    truncated = str(tmp_path / "truncated_text_sentence")
    with open(f"{data}.bin", "rb") as source, open(f"{truncated}.bin", "wb") as target:
        target.write(source.read()[:-100])
    with open(f"{data}.idx", "rb") as source, open(f"{truncated}.idx", "wb") as target:
        target.write(source.read())
    missing_vocab = bert_argv(str(tmp_path / "a"), corpus)
    missing_vocab[missing_vocab.index(vocab)] = str(tmp_path / "nope.txt")
    runs = [
        missing_vocab,
        bert_argv(str(tmp_path / "b"), (vocab, truncated)),
        bert_argv(str(tmp_path / "c"), (vocab, str(tmp_path / "absent_text_sentence"))),
    ]
    messages = run_distributed(failing_runs_worker, 2, runs, timeout=300)[1]  # a follower rank's view
    assert messages[0] == (
        f"pretrain_bert: --vocab-file {tmp_path / 'nope.txt'}: no such file (needed by BertWordPieceLowerCase)"
    )
    assert messages[1].startswith(f"pretrain_bert: {truncated}.bin: data file has ")
    assert "the .bin is truncated or belongs to another index" in messages[1]
    assert messages[2].startswith(f"pretrain_bert: {tmp_path / 'absent_text_sentence'}.idx: file not found")


def test_sigkill_and_resume_is_bitwise(tmp_path, corpus) -> None:
    """With dropout on, a run killed by SIGKILL and resumed with --load logs exactly the uninterrupted losses."""
    output, expected, resumed = sigkill_and_resume(
        "megatron_train.pretrain_bert", lambda run, *flags: bert_argv(run, corpus, *flags), tmp_path, 12
    )
    assert "sop loss:" in output
    assert losses(resumed) == losses(expected)  # bitwise: JSON floats
