"""pretrain_hybrid on gloo: a hybrid model continues a one-process checkpoint with the same losses under TP=2 + SP,
DP=2 with the distributed optimizer, PP=2 at the pattern's cut, EP=2 and CP=2 (ring attention, the Mamba mixer's
all-to-all, --reset-attention-mask documents); a TP=2 checkpoint loads at TP=1; a SIGKILLed
run resumes bitwise; Megatron's examples/mamba scripts parse as written and train (pretrain_mamba) tiny."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from megatron_train.arguments import build_parser, parse_args
from megatron_train.checkpointing import load_model_for_inference
from megatron_train.checkpointing.files import checkpoint_dir, model_shard_dir
from megatron_train.evaluation.wikitext import evaluate_wikitext
from megatron_train.models.hybrid import MambaModel
from megatron_train.pretrain_mamba import main as pretrain_mamba
from megatron_train.tasks import main as tasks_main
from megatron_train.tokenizer import tokenizer_from_config
from megatron_train.tools import checkpoint_util
from megatron_train.tools import run_text_generation_server as server_tool
from tests.helpers.distributed import run_distributed
from tests.helpers.megatron_examples import example_argv
from tests.helpers.training import (
    pretrain_worker,
    read_marker,
    sigkill_and_resume,
    tiny_args,
    train_losses,
    write_corpus,
)

# A hybrid of every layer kind, cut into two pipeline stages; Mamba heads 8 and groups 2 split over TP=2; the MoE
# layer's 4 experts over EP=2 (dropless, so every layout routes the same tokens).
PATTERN = "M*E|M-"
HYBRID_FLAGS = [
    "--model-family", "hybrid", "--hybrid-layer-pattern", PATTERN, "--mamba-state-dim", "8", "--mamba-head-dim",
    "8", "--mamba-num-groups", "2", "--position-embedding-type", "none", "--normalization", "RMSNorm",
    "--split", "90,10,0", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--reset-attention-mask",
    "--num-experts", "4", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
    "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
]  # fmt: skip
LAYOUTS = {  # continued from the one-process checkpoint at iteration 2
    "tp1": (1, []),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2-distributed-optimizer": (2, ["--use-distributed-optimizer"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    # a rank holds 4 of the 8 Mamba heads and 1 of the 2 groups over the whole sequence
    "cp2": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
}


def hybrid_argv(run_dir: str, data: str, *extra: str) -> list[str]:
    argv = tiny_args(run_dir, "--data-path", data, *HYBRID_FLAGS, *extra)
    layers = argv.index("--num-layers")  # the pattern sets the layer count
    return argv[:layers] + argv[layers + 2 :]


@pytest.fixture(scope="module")
def continued(tmp_path_factory) -> tuple[str, dict[str, list[dict]]]:
    """(the one-process run, 2 iterations saved; the logged records of iterations 3..5 continuing it per
    layout)."""
    tmp = tmp_path_factory.mktemp("hybrid")
    data = write_corpus(str(tmp))
    base = str(tmp / "base")
    base_argv = hybrid_argv(base, data, "--train-iters", "5", "--exit-interval", "2")  # the same schedule
    run_distributed(pretrain_worker, 1, [base_argv], timeout=300)
    records = {}
    for world_size in (1, 2):
        names = [name for name, (size, _) in LAYOUTS.items() if size == world_size]
        runs = [
            hybrid_argv(
                str(tmp / name),
                data,
                "--train-iters",
                "5",
                *LAYOUTS[name][1],
                "--load",
                base,
                "--no-load-rng",
            )
            for name in names
        ]
        last_rank = run_distributed(pretrain_worker, world_size, runs, timeout=300)[-1]
        for name, logged in zip(names, last_rank, strict=True):
            records[name] = [r for r in logged if "split" not in r]
    return str(tmp), records


@pytest.mark.processes
@pytest.mark.parametrize("name", [name for name in LAYOUTS if name != "tp1"])
def test_a_hybrid_model_continues_a_one_process_checkpoint_with_the_same_losses(continued, name) -> None:
    """The LM loss and the MoE layer's aux and z losses, which the iteration line logs after it."""
    _, records = continued
    reference = records["tp1"]
    assert len({r["lm loss"] for r in reference}) == 3 and all(r["z_loss"] > 0 for r in reference)
    assert list(reference[0]).index("lm loss") < list(reference[0]).index("load_balancing_loss")
    for key in ("lm loss", "load_balancing_loss", "z_loss"):
        np.testing.assert_allclose(
            [r[key] for r in records[name]], [r[key] for r in reference], rtol=1e-5, err_msg=f"{name} {key}"
        )


@pytest.mark.processes
def test_tp2_and_ep2_checkpoints_load_at_tp1_ep1_with_the_tp1_runs_logits(continued, tmp_path) -> None:
    tmp, _ = continued
    split, config = load_model_for_inference(f"{tmp}/tp2-sp", device="cpu")
    whole, _ = load_model_for_inference(f"{tmp}/tp1", device="cpu")
    experts, _ = load_model_for_inference(f"{tmp}/ep2", device="cpu")
    assert isinstance(split, MambaModel) and config.model.hybrid_layer_pattern == PATTERN
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(split(tokens), whole(tokens), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(experts(tokens), whole(tokens), rtol=1e-4, atol=1e-4)
    assert read_marker(f"{tmp}/pp2") == 5
    resharded = str(tmp_path / "tp1-pp2-ep2")  # offline: TP=2 -> TP=1 x PP=2 (at the pattern's cut) x EP=2
    checkpoint_util.main(["--load-dir", f"{tmp}/tp2-sp", "--save-dir", resharded, "--target-tensor-parallel-size",
                          "1", "--target-pipeline-parallel-size", "2", "--target-expert-model-parallel-size",
                          "2"])  # fmt: skip
    # the first stage's E layer holds the experts, half in each EP rank's folder (as GPT MoE saves them)
    assert os.path.isdir(model_shard_dir(checkpoint_dir(resharded, 5), 0, 0, 2, ep_rank=1))
    offline, _ = load_model_for_inference(resharded, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(offline(tokens), split(tokens))


@pytest.mark.processes
@pytest.mark.parametrize("task", ["WIKITEXT103", "LAMBADA"])
def test_zero_shot_tasks_score_a_hybrid_checkpoint(continued, tmp_path, task) -> None:
    tmp, _ = continued
    model, config = load_model_for_inference(f"{tmp}/tp2-sp", device="cpu")
    tokenizer = tokenizer_from_config(config.tokenizer)
    counting = " ".join(str(i % 100) for i in range(40, 100))  # the corpus' counting documents
    data = tmp_path / "data"
    data.write_text(json.dumps({"text": counting}) + "\n" if task == "LAMBADA" else counting + "\n")
    metrics = tasks_main.main(["--task", task, "--valid-data", str(data), "--load", f"{tmp}/tp2-sp"])
    if task == "WIKITEXT103":
        expected = evaluate_wikitext(model, tokenizer, str(data), config.model.seq_length, None)
        assert metrics["avg_loss"] == pytest.approx(expected.avg_loss, rel=1e-6)
    else:
        assert metrics["total"] == 1 and metrics["accuracy"] in (0.0, 1.0)


@pytest.mark.processes
def test_a_sigkilled_hybrid_run_resumes_bitwise(tmp_path) -> None:
    data = write_corpus(str(tmp_path))

    def argv_for(run_dir: str, *flags: str) -> list[str]:
        return [
            word for word in hybrid_argv(run_dir, data, *flags) if word not in ("--model-family", "hybrid")
        ]

    _, reference, resumed = sigkill_and_resume("megatron_train.pretrain_hybrid", argv_for, tmp_path, 8)
    assert [r["lm loss"] for r in resumed] == [r["lm loss"] for r in reference]
    assert len(reference) == 8


@pytest.mark.processes  # the script runs under bash with a stand-in torchrun
def test_every_flag_of_megatrons_mamba_examples_is_known(tmp_path) -> None:
    train = example_argv("mamba_train.sh", tmp_path, "data_text_document", "tokenizer.model",
                         entry="../../pretrain_hybrid.py")  # fmt: skip
    parser = build_parser()
    assert [
        word for word in train if word.startswith("--") and word not in parser._option_string_actions
    ] == []
    config = parse_args(train, world_size=8)
    assert (config.model.num_layers, config.model.position_embedding_type) == (48, "none")
    assert config.compat.spec == ["megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"]

    serve = example_argv("mamba_run_text_gen_server_8b.sh", tmp_path, "ckpt", "tokenizer.model",
                         entry="../../tools/run_hybrid_text_generation_server.py")  # fmt: skip
    args = server_tool.build_parser(serve).parse_args(serve)
    assert (args.load, args.hybrid_layer_pattern.count("*"), args.seed) == ("ckpt", 4, 42)


@pytest.mark.processes  # the script runs under bash with a stand-in torchrun
def test_megatrons_mamba_example_trains_tiny_under_pretrain_mamba(tmp_path) -> None:
    """examples/mamba/train.sh with its sizes shrunk (and the tokenizer, data and batch to this machine's): every
    other flag as the script passes it."""
    train = example_argv(
        "mamba_train.sh", tmp_path, "data", "tokenizer.model", entry="../../pretrain_hybrid.py"
    )
    shrink = {
        "--hybrid-layer-pattern": "M-*M", "--hidden-size": "32", "--num-attention-heads": "4",
        "--num-query-groups": "2", "--seq-length": "16", "--max-position-embeddings": "16",
        "--train-samples": "16", "--lr-warmup-samples": "4", "--lr-decay-samples": "12", "--micro-batch-size": "2",
        "--global-batch-size": "4", "--log-interval": "1", "--save-interval": "4", "--eval-interval": "4", "--eval-iters": "1",
        "--data-path": write_corpus(str(tmp_path)), "--save": str(tmp_path / "ckpt"),
        "--load": str(tmp_path / "ckpt"), "--tokenizer-type": "NullTokenizer",
        "--tokenizer-model": None, "--distributed-backend": "gloo",
    }  # fmt: skip
    argv = []
    for index, word in enumerate(train):
        if word.startswith("--"):
            if word in shrink and shrink[word] is None:
                continue
            argv += [word, shrink[word]] if word in shrink else [word]
        elif not (index and train[index - 1] in shrink):
            argv.append(word)
    argv += ["--vocab-size", "127", "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2",
             "--tensorboard-dir", str(tmp_path / "tb"), "--data-cache-path", str(tmp_path / "cache")]  # fmt: skip
    pretrain_mamba(argv)
    losses = train_losses(str(tmp_path / "ckpt"))
    assert len(losses) == 4 and all(np.isfinite(losses))
