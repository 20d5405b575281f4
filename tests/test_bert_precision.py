"""BERT pretraining in bf16 and fp16: from the same initial weights the losses (`lm loss`, `sop loss`) stay
close to fp32's, and fp16's dynamic loss scale skips the steps whose gradients overflow."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.training import LOSS_KEYS, bert_argv, bert_worker, losses
from tests.helpers.wordpiece_corpus import write_wordpiece_corpus

pytestmark = pytest.mark.processes  # every test here starts processes


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """(vocab file, --data-path prefix) of a sentence-split WordPiece corpus."""
    return write_wordpiece_corpus(tmp_path_factory.mktemp("bert-precision-data"), 300)


@pytest.fixture(scope="module")
def precision_losses(tmp_path_factory, corpus) -> dict[str, list[dict]]:
    """Six steps from the same initial weights in fp32, bf16 and fp16 (a fitting and an overflowing loss scale)."""
    tmp = tmp_path_factory.mktemp("bert-precision")
    runs = {
        "fp32": [],
        "bf16": ["--bf16"],
        "fp16": ["--fp16", "--initial-loss-scale", "4096"],
        # 2^20 overflows fp16 grads: the scale halves per step (hysteresis 1) until they fit; those steps skip
        "fp16-overflow": ["--fp16", "--initial-loss-scale", "1048576", "--hysteresis", "1"],
    }
    argvs = [
        bert_argv(str(tmp / name), corpus, *flags, "--train-iters", "6", "--use-cpu-initialization")
        for name, flags in runs.items()
    ]
    results = run_distributed(bert_worker, 1, argvs, timeout=300)[-1]
    return dict(zip(runs, results, strict=True))


@pytest.mark.parametrize(("precision", "rtol"), [("bf16", 2e-2), ("fp16", 5e-3)])
def test_bf16_and_fp16_losses_are_close_to_fp32(precision_losses, precision, rtol) -> None:
    reference, records = losses(precision_losses["fp32"]), losses(precision_losses[precision])
    for key in LOSS_KEYS:
        assert all(np.isfinite(records[key])) and len(records[key]) == 6
        np.testing.assert_allclose(records[key], reference[key], rtol=rtol, err_msg=f"{precision} {key}")
        assert records[key] != reference[key]  # computed in the lower precision
    assert {r["number of skipped iterations"] for r in precision_losses[precision]} == {0}


def test_fp16_loss_scaling_skips_overflowing_bert_steps(precision_losses) -> None:
    steps = precision_losses["fp16-overflow"]
    skipped = [r["number of skipped iterations"] for r in steps]
    scales = [r["loss scale"] for r in steps]
    assert skipped[0] == 1 and skipped[-1] == 0
    assert scales == sorted(scales, reverse=True) and scales[-1] < 2**20
    assert [r["lm loss"] is None for r in steps] == [bool(s) for s in skipped]
    assert all(np.isfinite(r["sop loss"]) for r in steps if r["sop loss"] is not None)
