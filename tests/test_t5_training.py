"""`pretrain_t5` on the training engine: the same `lm loss` under TP=2 + SP and DP=2 with the distributed
optimizer (and full recompute) as in one process; a SIGKILLed run resumes bitwise; a TP=2 checkpoint continues
at TP=1; pipeline parallelism is refused naming the flag."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megatron_train.arguments import config_to_argv, parse_args
from megatron_train.checkpointing.inference import load_model_for_inference
from megatron_train.families.t5 import T5, check_t5_config
from megatron_train.models.config import TransformerConfig
from megatron_train.models.t5 import T5Model
from megatron_train.tools.checkpoint_util import convert_checkpoint
from tests.helpers.distributed import run_distributed
from tests.helpers.megatron_examples import example_argv
from tests.helpers.training import RECOMPUTE, TP2, read_metrics, sigkill_and_resume, tiny_args
from tests.helpers.wordpiece_corpus import write_wordpiece_corpus

RELATIVE = ["--position-embedding-type", "relative", "--relative-attention-num-buckets", "8"]
LAYOUTS = {  # name: (world size, flags); the 158-token vocabulary pads to 192 rows at TP=1, 256 at TP=2
    "tp1": (1, []),
    "tp1-recompute": (1, RECOMPUTE),
    "tp2-sp": (2, [*TP2, "--sequence-parallel"]),
    "dp2-distributed-optimizer": (2, ["--use-distributed-optimizer"]),
}
MIXED_PRECISION = {"bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "1024"]}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """(vocab file, --data-path prefix) of a sentence-split WordPiece corpus."""
    return write_wordpiece_corpus(tmp_path_factory.mktemp("t5-data"), 300, vocab_extra_ids=10)


def t5_argv(run_dir: str, corpus: tuple[str, str], *extra: str) -> list[str]:
    """Megatron's T5 flags (encoder/decoder layers and lengths) on the tiny GPT run's other settings."""
    vocab, data = corpus
    argv = tiny_args(
        run_dir, "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab, "--vocab-extra-ids", "10",
        "--make-vocab-size-divisible-by", "64", "--data-path", data, "--split", "90,10,0", "--data-cache-path",
        os.path.join(run_dir, "cache"), "--train-iters", "4", "--hidden-dropout", "0.0", "--attention-dropout",
        "0.0", *extra,
    )  # fmt: skip
    for flag in ("--num-layers", "--seq-length", "--max-position-embeddings", "--vocab-size"):
        at = argv.index(flag)  # the GPT run's shape and NullTokenizer size: replaced by T5's
        argv = argv[:at] + argv[at + 2 :]
    return [
        "--encoder-num-layers", "2", "--decoder-num-layers", "2", "--encoder-seq-length", "32",
        "--decoder-seq-length", "16", "--max-position-embeddings", "32", *argv,
    ]  # fmt: skip


def t5_worker(rank: int, world_size: int, runs: list[list[str]]) -> list[list[float]]:
    """Run pretrain_t5 once per argv in this process group; return each run's training `lm loss`es."""
    from megatron_train.pretrain_t5 import main

    results = []
    for argv in runs:
        main(argv)
        save = argv[argv.index("--save") + 1]
        records = read_metrics(save) if rank == world_size - 1 else []
        results.append([r["lm loss"] for r in records if "split" not in r])
    return results


@pytest.fixture(scope="module")
def layout_losses(tmp_path_factory, corpus) -> dict[str, list[float]]:
    tmp = tmp_path_factory.mktemp("t5-layouts")
    results = {}
    layouts = LAYOUTS | {name: (1, flags) for name, flags in MIXED_PRECISION.items()}
    for world_size in sorted({size for size, _ in layouts.values()}):
        names = [name for name, (size, _) in layouts.items() if size == world_size]
        runs = [
            t5_argv(str(tmp / name), corpus, *layouts[name][1], *RELATIVE, "--use-cpu-initialization")
            for name in names
        ]
        last_rank = run_distributed(t5_worker, world_size, runs, timeout=300)[-1]
        results |= dict(zip(names, last_rank, strict=True))
    return results


@pytest.mark.processes
@pytest.mark.parametrize("name", [name for name in LAYOUTS if name != "tp1"])
def test_t5_losses_equal_one_process_under_every_layout(layout_losses, name) -> None:
    reference = layout_losses["tp1"]
    assert len(reference) == 4 and len(set(reference)) == 4 and reference[-1] < reference[0]
    np.testing.assert_allclose(layout_losses[name], reference, rtol=1e-5, err_msg=name)


@pytest.mark.processes
@pytest.mark.parametrize("name", MIXED_PRECISION)
def test_t5_trains_in_bf16_and_fp16_close_to_fp32(layout_losses, name) -> None:
    np.testing.assert_allclose(layout_losses[name], layout_losses["tp1"], rtol=1e-3, err_msg=name)


@pytest.mark.processes
def test_checkpoint_saved_at_tp2_continues_at_tp1_with_tp2s_losses(tmp_path, corpus) -> None:
    """Relative positions: the bias tables are split over TP by head (dim 1), merged back at TP=1."""
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    runs = [
        t5_argv(full, corpus, *TP2, *RELATIVE),
        t5_argv(split, corpus, *TP2, *RELATIVE, "--exit-interval", "2"),
    ]
    reference, stopped = run_distributed(t5_worker, 2, runs, timeout=300)[-1]
    assert stopped == reference[:2]
    (resumed,) = run_distributed(t5_worker, 1, [t5_argv(split, corpus, *RELATIVE)], timeout=300)[-1]
    np.testing.assert_allclose(resumed[2:], reference[2:], rtol=1e-5)

    # Offline (checkpoint_util) the TP=2 checkpoint becomes a TP=1 one holding the same model.
    convert_checkpoint(full, str(tmp_path / "tp1"), target_tp=1, true_vocab_size=158)
    (model, config), (converted, _) = (
        load_model_for_inference(full),
        load_model_for_inference(str(tmp_path / "tp1")),
    )
    assert isinstance(model, T5Model) and config.model.num_decoder_layers == 2
    assert model.encoder_relative_position.weight.shape == (8, 4)
    # The TP=2 checkpoint pads the 158-token vocabulary to 256 rows, the converted TP=1 one to 192.
    assert (model.output_layer.bias.shape, converted.output_layer.bias.shape) == ((256,), (192,))
    encoder_ids, decoder_ids = torch.randint(0, 158, (1, 32)), torch.randint(0, 158, (1, 16))
    with torch.no_grad():
        logits, converted_logits = model(encoder_ids, decoder_ids), converted(encoder_ids, decoder_ids)
    torch.testing.assert_close(converted_logits[..., :158], logits[..., :158], rtol=1e-6, atol=1e-6)
    assert torch.isinf(converted_logits[..., 158:]).all() and logits.abs()[..., :158].max() > 0.1


@pytest.mark.processes
def test_sigkill_and_resume_is_bitwise(tmp_path, corpus) -> None:
    """Learned positions (Megatron's default), dropout on: a run killed by SIGKILL and resumed with --load logs
    exactly the uninterrupted losses."""
    output, expected, resumed = sigkill_and_resume(
        "megatron_train.pretrain_t5", lambda run, *flags: t5_argv(run, corpus, *flags), tmp_path, 10
    )
    assert "lm loss:" in output
    assert [r["lm loss"] for r in resumed] == [r["lm loss"] for r in expected]  # bitwise: JSON floats


def test_pipeline_parallel_is_refused_naming_the_flag(tmp_path, corpus, capsys) -> None:
    argv = t5_argv(str(tmp_path), corpus, "--pipeline-model-parallel-size", "2")
    with pytest.raises(
        ValueError, match="--pipeline-model-parallel-size 2: T5's encoder and decoder are not split"
    ):
        T5.layouts.check(T5.name, parse_args(argv, world_size=2))
    with pytest.raises(SystemExit):  # argparse's error: exit status 2, the reason on stderr
        parse_args(t5_argv(str(tmp_path), corpus, "--pipeline-model-parallel-split-rank", "1"))
    assert (
        "--pipeline-model-parallel-split-rank 1: splitting T5's encoder and decoder"
        in capsys.readouterr().err
    )


def test_encoder_flags_are_other_names_of_num_layers_and_seq_length(tmp_path, corpus) -> None:
    parsed = parse_args(t5_argv(str(tmp_path), corpus))
    assert parse_args(config_to_argv(parsed)) == parsed  # flows pass configs on as flags: both names agree
    config = parsed.model
    assert (config.num_layers, config.num_decoder_layers, config.seq_length, config.decoder_seq_length) == (
        2, 2, 32, 16,
    )  # fmt: skip
    shape = dict(hidden_size=32, num_attention_heads=4, encoder_seq_length=32)
    assert (
        TransformerConfig(num_layers=3, **shape).num_decoder_layers == 3
    )  # Megatron: the decoder as the encoder
    with pytest.raises(ValueError, match="--num-layers 3 and --encoder-num-layers 2 name the same setting"):
        TransformerConfig(num_layers=3, encoder_num_layers=2, **shape)
    with pytest.raises(ValueError, match="--decoder-seq-length 64 exceeds --max-position-embeddings 32"):
        TransformerConfig(num_layers=1, decoder_seq_length=64, **shape)
    with pytest.raises(ValueError, match="--encoder-seq-length 32 exceeds --max-position-embeddings 16"):
        TransformerConfig(num_layers=1, max_position_embeddings=16, **shape)


@pytest.mark.processes
def test_megatron_t5_example_parses_with_its_t5_settings(tmp_path) -> None:
    """Megatron's examples/t5/train_t5_220m_distributed.sh, run unchanged: every flag it gives pretrain_t5.py
    is ours, and the T5 shape lands where pretrain_t5 reads it."""
    argv = example_argv(
        "train_t5_220m_distributed.sh", tmp_path, "ckpt", "tb", "vocab.txt", "data", entry="pretrain_t5.py"
    )
    config = parse_args(argv, world_size=8)
    check_t5_config(config)
    model = config.model
    assert (model.num_layers, model.num_decoder_layers, model.kv_channels, model.ffn_hidden_size) == (
        12,
        12,
        64,
        3072,
    )
    assert (model.seq_length, model.decoder_seq_length, model.max_position_embeddings) == (512, 128, 512)
    assert (config.tokenizer.vocab_extra_ids, model.init_method_std, model.bf16) == (100, 0.015, True)
