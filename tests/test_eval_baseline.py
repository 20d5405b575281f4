"""The eval flow's baseline: `--model hybrid --baseline gpt` parses (make eval MODEL=hybrid), a family that does not
pretrain on a corpus is refused naming the flag, and the report puts both runs side by side."""

from __future__ import annotations

import pytest

from flows.eval import parse
from stages.evaluate import markdown_report


def test_the_eval_flow_takes_a_model_and_a_baseline_family(capsys) -> None:
    config = parse(["--model", "hybrid", "--baseline", "gpt", "--", "--train-iters", "10"])
    assert (config.pretrain.model, config.baseline) == ("hybrid", "gpt")
    assert "--train-iters" in config.pretrain.megatron_args
    with pytest.raises(SystemExit):
        parse(["--model", "hybrid", "--baseline", "bert_classifier"])
    assert (
        "--baseline: model 'bert_classifier' does not pretrain on a tokenized corpus"
        in capsys.readouterr().err
    )


def test_the_report_shows_the_baseline_beside_the_model() -> None:
    run = {"checkpoint": "a", "family": "hybrid", "iteration": 400, "consumed_train_samples": 6400,
           "parameters": 1456112, "end_of_training_validation_loss": 4.5347, "held_out_loss": 4.524}  # fmt: skip
    baseline = {**run, "checkpoint": "b", "family": "gpt", "parameters": 1858304,
                "end_of_training_validation_loss": 4.7939, "held_out_loss": 4.7995}  # fmt: skip
    text = markdown_report({"run": run, "baseline": baseline, "metrics": {}, "generations": []})
    assert "| family | hybrid | gpt |" in text
    assert "| parameters | 1,456,112 | 1,858,304 |" in text
    assert "| end of training validation loss | 4.5347 | 4.7939 |" in text
    assert "| held out loss | 4.5240 | 4.7995 |" in text
