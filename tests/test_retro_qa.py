"""Zero-shot QA (`tasks.main --task RETRO-QA`): SQuAD-normalized exact match and F1 on known answers, the prompt
in Megatron's short-span form with the contexts, bad records named by file and line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron_train.tasks import main as tasks_main
from megatron_train.tasks.retro_qa import (
    QAExample,
    answer_questions,
    evaluate_qa,
    normalize_answer,
    qa_prompt,
    read_qa,
    score_answers,
)
from tests.helpers.generation import CharTokenizer, build_tiny_gpt
from tests.helpers.retro_corpus import write_jsonl


def test_squad_normalization_exact_match_and_f1_on_known_answers():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple, a pear") == "apple pear"
    examples = [
        QAExample("where?", ("Eiffel Tower",)),
        QAExample("capital?", ("Paris",)),
        QAExample("colour?", ("red", "dark green")),
    ]
    result = score_answers(["the Eiffel Tower.", "paris france", "green"], examples)
    assert result.exact_match == pytest.approx(1 / 3)
    # Per question (precision, recall, F1): (1, 1, 1); (1/2, 1, 2/3); best answer "dark green": (1, 1/2, 2/3).
    assert result.precision == pytest.approx((1 + 0.5 + 1) / 3)
    assert result.recall == pytest.approx((1 + 1 + 0.5) / 3)
    assert result.f1 == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)
    assert result.megatron_line("RETRO-QA") == (
        "Exact Match: 0.3333; Method: RETRO-QA; Precision: 0.8333; recall: 0.8333; f1: 0.7778"
    )


def test_prompt_holds_the_first_contexts_and_megatrons_short_span_question(tmp_path):
    path = write_jsonl(
        tmp_path / "qa.jsonl",
        [
            {
                "question": "who?",
                "answers": ["bo"],
                "ctxs": [{"title": "A", "text": "x"}, {"title": "B", "text": "y"}],
            }
        ],
    )
    (example,) = read_qa(path)
    prompt = qa_prompt(example, ft_neighbours=1)
    assert "title: A, source: x\n\n" in prompt and "title: B" not in prompt
    assert prompt.endswith(
        "User: Answer the following question with a short span. who?\n\nAssistant: The answer is"
    )


@pytest.mark.parametrize(
    "record, message",
    [
        ({"answers": ["a"]}, '"question" must be a string'),
        ({"question": "q", "answers": []}, '"answers" must be a non-empty list'),
        ({"question": "q", "answers": ["a"], "ctxs": [{"title": "t"}]}, '"ctxs" must be a list'),
    ],
)
def test_bad_records_are_named_by_file_and_line(tmp_path, record, message):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answers": ["a"]}, record])
    with pytest.raises(ValueError, match=f"qa.jsonl:2: {message}"):
        read_qa(path)


def test_evaluation_scores_the_models_greedy_answers(tmp_path):
    model, tokenizer = build_tiny_gpt(max_position_embeddings=512), CharTokenizer()
    questions = [{"question": "who?", "ctxs": [{"title": "t", "text": "bo"}]}, {"question": "when?"}]
    examples = read_qa(write_jsonl(tmp_path / "probe.jsonl", [{**q, "answers": ["x"]} for q in questions]))
    answers = answer_questions(model, tokenizer, examples, 1, 6, batch_size=2)
    assert answers == answer_questions(
        model, tokenizer, examples, 1, 6, batch_size=1
    )  # batching changes nothing
    assert all("\n" not in answer for answer in answers) and normalize_answer(answers[0])
    # The first question's answer is right, the second's not: EM 0.5, F1 0.5.
    records = [{**questions[0], "answers": [answers[0]]}, {**questions[1], "answers": ["zzz zzz"]}]
    path = write_jsonl(tmp_path / "qa.jsonl", records)
    result = evaluate_qa(model, tokenizer, path, 1, 6, batch_size=2)
    assert result.predictions == answers and result.num_examples == 2
    assert result.exact_match == 0.5 and result.f1 == 0.5


def test_task_main_runs_retro_qa_and_writes_the_numbers(tmp_path, monkeypatch, capsys):
    records = [{"question": "q?", "answers": ["a"]}]
    path = write_jsonl(tmp_path / "qa.jsonl", records)
    model, tokenizer = build_tiny_gpt(max_position_embeddings=512), CharTokenizer()
    monkeypatch.setattr(
        tasks_main,
        "load_for_inference",
        lambda args, device: (model, tokenizer, SimpleNamespace(model=model.config)),
    )
    results = tmp_path / "results.json"
    argv = ["--task", "RETRO-QA", "--load", "CKPT", "--valid-data", path, "--out-seq-length", "4"]
    metrics = tasks_main.main([*argv, "--results-json", str(results)])
    assert metrics["num_examples"] == 1 and metrics["exact_match"] in (0.0, 1.0)
    assert "Exact Match: " in capsys.readouterr().out
    assert json.loads(results.read_text())["f1"] == metrics["f1"]


def test_a_line_of_gigabytes_is_refused_before_it_is_read_whole(tmp_path):
    """A JSON Lines record longer than storage.documents.MAX_RECORD_BYTES (64 MiB): the reader stops there with
    the file and the line, instead of reading gigabytes into memory (a sparse file: no disk is spent)."""
    from storage.documents import MAX_RECORD_BYTES

    path = tmp_path / "qa.jsonl"
    with open(path, "wb") as handle:
        handle.write(json.dumps({"question": "q", "answers": ["a"]}).encode() + b"\n")
        handle.truncate(handle.tell() + (1 << 30))  # a second line of a gigabyte, with no newline
    with pytest.raises(ValueError) as refused:
        read_qa(str(path))
    assert str(refused.value) == (
        f"{path}:2: a line of over {MAX_RECORD_BYTES} bytes, more than a record of this file may hold; it is not "
        "JSON Lines (one record per line), or a record is damaged"
    )
