"""The pretrain entry points' shared shell (`training.entry.run_pretrain`): what each refuses, naming itself and
the flag, before any process group or data is touched."""

from __future__ import annotations

import importlib

import pytest

from tests.test_training import tiny_args


@pytest.mark.parametrize(
    ("entry", "model", "extra"),
    [("pretrain_bert", "BERT", []), ("pretrain_t5", "T5", ["--decoder-seq-length", "16"])],
)
def test_per_token_loss_is_refused_by_models_with_a_micro_batch_loss(tmp_path, entry, model, extra) -> None:
    main = importlib.import_module(f"megatron_train.{entry}").main
    argv = tiny_args(str(tmp_path), "--mock-data", "--train-iters", "1", "--calculate-per-token-loss", *extra)
    with pytest.raises(
        SystemExit, match=f"{entry}: --calculate-per-token-loss is GPT's; Megatron's {model} loss"
    ):
        main(argv)


@pytest.mark.parametrize("entry", ["pretrain_gpt", "pretrain_bert", "pretrain_t5"])
def test_a_tokenizer_error_names_the_entry_point(tmp_path, entry) -> None:
    main = importlib.import_module(f"megatron_train.{entry}").main
    t5_flags = ["--decoder-seq-length", "16"] if entry == "pretrain_t5" else []
    argv = tiny_args(str(tmp_path), "--mock-data", "--train-iters", "1", *t5_flags)
    argv += ["--tokenizer-type", "BertWordPieceLowerCase"]
    with pytest.raises(SystemExit, match=f"^{entry}: BertWordPieceLowerCase needs --vocab-file"):
        main(argv)
