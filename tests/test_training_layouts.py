"""Layout-invariant runs: with --use-cpu-initialization the same `pretrain_gpt` command logs the same losses (and,
with --log-params-norm --log-num-zeros-in-grad, the whole model's params norm and zero grad entries) from
iteration 1 under TP=1, TP=2 + SP, PP=2, TP=2 x PP=2 and DP=2, with a vocabulary padded differently under TP=1
and TP=2; padded vocabulary rows take no part in the loss, its gradient or the model's logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_train.models.config import TransformerConfig
from megatron_train.models.gpt import GPTModel
from megatron_train.parallel import state
from megatron_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_train.tokenizer import vocab_size_with_padding
from tests.helpers.distributed import run_distributed
from tests.helpers.training import pretrain_worker, tiny_args, write_corpus

# NullTokenizer --vocab-size 127: ids 0..127 (eod 127, the corpus' eod), 128 in all; --make-vocab-size-divisible-by
# 48 pads that to 144 rows under TP=1 and to 192 under TP=2 (16 vs 64 padding rows).
VOCAB_FLAGS = ["--vocab-size", "127", "--make-vocab-size-divisible-by", "48"]
TRUE_VOCAB = 128
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {  # name: (world size, flags)
    "tp1": (1, []),
    "tp2-sp": (2, [*TP2, "--sequence-parallel"]),
    "pp2": (2, PP2),
    "dp2": (2, []),
    "tp2-pp2": (4, [*TP2, *PP2]),
}


def layout_argv(run_dir: str, data: str, *extra: str) -> list[str]:
    return tiny_args(
        run_dir, "--data-path", data, "--split", "90,10,0", "--train-iters", "4", "--hidden-dropout", "0.0",
        "--attention-dropout", "0.0", *VOCAB_FLAGS, *extra,
    )  # fmt: skip


def test_padding_differs_between_the_tested_tp_sizes() -> None:
    assert vocab_size_with_padding(TRUE_VOCAB, 48, 1) == 144
    assert vocab_size_with_padding(TRUE_VOCAB, 48, 2) == 192


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory) -> dict[str, dict[str, list[dict]]]:
    """Training records per layout, with and without --use-cpu-initialization and with document attention
    masks (--reset-attention-mask --reset-position-ids), one process group per size."""
    tmp = tmp_path_factory.mktemp("layouts")
    data = write_corpus(str(tmp))
    modes = {
        "cpu-init": ["--use-cpu-initialization", "--log-params-norm", "--log-num-zeros-in-grad"],
        "default": [],
        "documents": ["--use-cpu-initialization", "--reset-attention-mask", "--reset-position-ids"],
    }
    runs_by_mode: dict[str, dict[str, list[dict]]] = {mode: {} for mode in modes}
    for world_size in sorted({size for size, _ in LAYOUTS.values()}):
        names = [name for name, (size, _) in LAYOUTS.items() if size == world_size]
        runs, keys = [], []
        for name in names:
            for mode, flags in modes.items():
                runs.append(layout_argv(str(tmp / mode / name), data, *LAYOUTS[name][1], *flags))
                keys.append((mode, name))
        last_rank = run_distributed(pretrain_worker, world_size, runs, timeout=300)[-1]
        for (mode, name), records in zip(keys, last_rank, strict=True):
            runs_by_mode[mode][name] = [r for r in records if "split" not in r]
    return runs_by_mode


@pytest.fixture(scope="module")
def layout_losses(layout_runs) -> dict[str, dict[str, list[float]]]:
    return {
        mode: {name: [r["lm loss"] for r in records] for name, records in runs.items()}
        for mode, runs in layout_runs.items()
    }


@pytest.mark.processes
def test_params_norm_and_num_zeros_are_the_whole_models_under_every_layout(layout_runs) -> None:
    """The params norm is equal across layouts of one padding; the zero grad entries are the padded rows' (16 x 32
    at TP=1, 64 x 32 at TP=2) and the odd entry that rounds to exactly 0 (which differs with the summation order)."""
    for name, records in layout_runs["cpu-init"].items():
        padded_rows = 64 if name.startswith("tp2") else 16
        assert all(0 <= r["num zeros"] - padded_rows * 32 <= 4 for r in records), name
        reference = layout_runs["cpu-init"]["tp2-sp" if padded_rows == 64 else "tp1"]
        norms = [r["params norm"] for r in records]
        np.testing.assert_allclose(norms, [r["params norm"] for r in reference], rtol=1e-5, err_msg=name)


@pytest.mark.processes
@pytest.mark.parametrize("name", [name for name in LAYOUTS if name != "tp1"])
def test_use_cpu_initialization_logs_the_same_losses_under_every_layout(layout_losses, name) -> None:
    reference = layout_losses["cpu-init"]["tp1"]
    assert len(reference) == 4 and len(set(reference)) == 4
    np.testing.assert_allclose(layout_losses["cpu-init"][name], reference, rtol=1e-5, err_msg=name)


@pytest.mark.processes
@pytest.mark.parametrize("name", [name for name in LAYOUTS if name != "tp1"])
def test_document_attention_masks_log_the_same_losses_under_every_layout(layout_losses, name) -> None:
    reference = layout_losses["documents"]["tp1"]
    np.testing.assert_allclose(layout_losses["documents"][name], reference, rtol=1e-5, err_msg=name)
    # the samples hold several documents: masking attention at their ends changes the losses
    assert abs(reference[-1] - layout_losses["cpu-init"]["tp1"][-1]) > 1e-4


@pytest.mark.processes
def test_without_cpu_initialization_pipeline_stages_draw_other_weights(layout_losses) -> None:
    """The default keeps Megatron's per-stage seed offset: PP=2 starts from other layers than TP=1."""
    default = layout_losses["default"]
    assert abs(default["pp2"][0] - default["tp1"][0]) > 1e-4


@pytest.mark.processes
def test_checkpoint_saved_at_tp2_continues_at_tp1_with_tp2s_losses(tmp_path) -> None:
    """The padding shrinks from 64 to 16 rows when a TP=2 checkpoint is loaded at TP=1: the losses stay."""
    data = write_corpus(str(tmp_path))
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    runs = [layout_argv(full, data, *TP2), layout_argv(split, data, *TP2, "--exit-interval", "2")]
    reference, stopped = (
        [r["lm loss"] for r in records if "split" not in r]
        for records in run_distributed(pretrain_worker, 2, runs, timeout=300)[-1]
    )
    assert stopped == reference[:2]
    (resumed,) = run_distributed(pretrain_worker, 1, [layout_argv(split, data)], timeout=300)[-1]
    resumed_losses = [r["lm loss"] for r in resumed if "split" not in r]
    np.testing.assert_allclose(resumed_losses[2:], reference[2:], rtol=1e-5)


# -- padded vocabulary rows -------------------------------------------------------------------------------------


def test_cross_entropy_leaves_padding_columns_out_of_loss_and_gradient() -> None:
    torch.manual_seed(0)
    true_vocab, padded = 10, 16
    logits = torch.randn(3, 5, padded)
    logits[..., true_vocab:] += 20.0  # padding rows that would dominate the softmax
    logits.requires_grad_(True)
    target = torch.randint(0, true_vocab, (3, 5))
    loss = vocab_parallel_cross_entropy(logits, target, true_vocab)
    expected = F.cross_entropy(
        logits[..., :true_vocab].reshape(-1, true_vocab), target.reshape(-1), reduction="none"
    )
    torch.testing.assert_close(loss, expected.view(3, 5))
    loss.sum().backward()
    assert torch.all(logits.grad[..., true_vocab:] == 0)
    reference = logits.detach()[..., :true_vocab].clone().requires_grad_(True)
    F.cross_entropy(reference.reshape(-1, true_vocab), target.reshape(-1), reduction="sum").backward()
    torch.testing.assert_close(logits.grad[..., :true_vocab], reference.grad)


def _tp2_cross_entropy(
    rank: int, world_size: int, logits: torch.Tensor, target: torch.Tensor, true_vocab: int
):
    state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, target, true_vocab)
        loss.sum().backward()
        return loss.detach(), local.grad
    finally:
        state.destroy_model_parallel()


@pytest.mark.processes
def test_cross_entropy_under_tp2_with_a_rank_of_only_padding() -> None:
    """TP=2 over 16 columns with 6 real ones: rank 1 holds only padding; the loss equals TP=1's over 6 columns."""
    torch.manual_seed(1)
    logits, target = torch.randn(4, 16), torch.randint(0, 6, (4,))
    results = run_distributed(_tp2_cross_entropy, 2, logits, target, 6)
    expected = F.cross_entropy(logits[:, :6], target, reduction="none")
    for loss, _ in results:
        torch.testing.assert_close(loss, expected)
    assert torch.all(results[1][1] == 0) and torch.all(results[0][1][:, 6:] == 0)


def test_model_logits_give_padding_rows_no_probability() -> None:
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, true_vocab_size=10, hidden_dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    model = GPTModel(config, 16).eval()
    tokens = torch.randint(0, 10, (2, 8))
    logits = model(tokens)
    assert logits.shape == (2, 8, 16) and torch.all(logits[..., 10:] == -torch.inf)
    assert torch.isfinite(logits[..., :10]).all()
    per_token = model(tokens[:, :-1], labels=tokens[:, 1:])
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 16), tokens[:, 1:].reshape(-1), reduction="none")
    torch.testing.assert_close(per_token, expected.view(2, 7))
