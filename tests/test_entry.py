"""The pretrain entry points' shared shell (`training.entry.run_pretrain`): what each refuses, naming itself and
the flag, before any process group or data is touched; and the process-group session every run opens."""

from __future__ import annotations

import importlib
import os
from unittest import mock

import pytest
import torch.distributed as dist

from megatron_train.arguments import parse_args
from megatron_train.parallel import state
from megatron_train.training.setup import model_parallel_session
from tests.helpers.training import tiny_args


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


def test_model_parallel_session_tears_the_groups_down_after_an_error(tmp_path) -> None:
    config = parse_args(tiny_args(str(tmp_path), "--mock-data", "--train-iters", "1"))
    session = model_parallel_session(config, pipeline_size=1, virtual_pipeline_size=None)
    with mock.patch.dict(os.environ), pytest.raises(RuntimeError, match="the run failed"), session:
        assert dist.get_world_size() == 1 and state.model_parallel_is_initialized()
        raise RuntimeError("the run failed")
    assert not dist.is_initialized() and not state.model_parallel_is_initialized()
