"""Megatron-LM's own command lines. Its GPT-3 and Llama-3 example scripts run unchanged with a stand-in `torchrun`
that records the arguments: our parser takes every flag, and tiny versions (sizes shrunk, every other flag kept)
train on gloo. Every flag of the commands its README printed since 2020 and of its older example scripts (at
commit f2e72c8a16^) is listed by our entry point's --help; renamed flags are read as their successors with one
deprecation line, retired ones are refused naming the flag to use, and the README's commands with
--activations-checkpoint-method uniform run (tiny GPT, BERT and T5 pretraining, zero-shot WikiText and LAMBADA)."""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

import numpy as np
import pytest

from megatron_train import pretrain, pretrain_hybrid, pretrain_mamba
from megatron_train.arguments import build_parser, parse_args
from megatron_train.checkpointing import read_latest_iteration
from megatron_train.legacy_flags import TRAINING_FLAGS
from megatron_train.tasks import main as tasks_main
from megatron_train.tasks.finetune.finetune import finetune_config
from megatron_train.tokenizer.train import train_byte_level_bpe
from megatron_train.tools import checkpoint_util, run_hybrid_text_generation_server
from megatron_train.tools import run_text_generation_server as text_generation_server
from stages import tokenize as tokenize_stage
from storage.indexed_dataset import IndexedDatasetBuilder
from tests.helpers.distributed import run_distributed
from tests.helpers.megatron_examples import FIXTURES, example_argv, flag_names, shell_commands
from tests.helpers.training import pretrain_worker, tiny_args
from tests.helpers.wordpiece_corpus import write_wordpiece_corpus

GPT3 = "train_gpt3_175b_distributed.sh"
LLAMA3 = "train_llama3_8b_h100_fp8.sh"
FP8_FLAGS = ("--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather")


def _value_end(argv: list[str], start: int) -> int:
    end = start + 1
    while end < len(argv) and not argv[end].startswith("--"):
        end += 1
    return end


def without(argv: list[str], *flags: str) -> list[str]:
    """`argv` less each of `flags` and its values."""
    out, i = [], 0
    while i < len(argv):
        end = _value_end(argv, i)
        if argv[i] not in flags:
            out += argv[i:end]
        i = end
    return out


def override(argv: list[str], values: dict[str, str]) -> list[str]:
    """`argv` with the values of the given flags replaced (every flag must already be there)."""
    out, i = [], 0
    missing = set(values) - set(argv)
    assert not missing, f"not in the example: {missing}"
    while i < len(argv):
        end = _value_end(argv, i)
        out += [argv[i], *values[argv[i]].split()] if argv[i] in values else argv[i:end]
        i = end
    return out


@pytest.fixture
def gpt3_argv(tmp_path) -> list[str]:
    return example_argv(
        GPT3, tmp_path, "ckpt", "tb", "gpt2-vocab.json", "gpt2-merges.txt", "data_text_document"
    )


@pytest.fixture
def llama3_argv(tmp_path) -> list[str]:
    return example_argv(LLAMA3, tmp_path, str(tmp_path / "ckpt"), str(tmp_path / "tb"))


@pytest.mark.processes
def test_parser_takes_every_flag_of_both_examples(gpt3_argv, llama3_argv) -> None:
    parser = build_parser()
    for argv in (gpt3_argv, llama3_argv):
        flags = [word for word in argv if word.startswith("--")]
        assert [flag for flag in flags if flag not in parser._option_string_actions] == []
        parser.parse_args(argv)
    assert len({w for w in gpt3_argv + llama3_argv if w.startswith("--")}) == 84

    gpt3 = parse_args(gpt3_argv, world_size=128)
    assert (gpt3.parallel.tensor_model_parallel_size, gpt3.parallel.pipeline_model_parallel_size) == (8, 16)
    assert gpt3.training.step_batch_size_schedule == [
        "0:16",
        "2.4B:320",
        "4.8B:624",
        "7.2B:928",
        "9.6B:1232",
        "12B:1536",
    ]
    assert (gpt3.training.global_batch_size, gpt3.model.fp16, gpt3.compat.attention_backend) == (
        1536,
        True,
        "auto",
    )

    llama3 = parse_args(without(llama3_argv, *FP8_FLAGS), world_size=8)
    training, model = llama3.training, llama3.model
    assert training.calculate_per_token_loss and training.grad_reduce_in_bf16 and training.manual_gc
    assert not training.accumulate_allreduce_grads_in_fp32  # bf16 grads stay bf16 with --grad-reduce-in-bf16
    assert training.overlap_param_gather and llama3.parallel.use_distributed_optimizer
    assert (training.empty_unused_memory_level, llama3.optimizer.decoupled_lr) == (1, 5.0e-4)
    assert model.apply_layernorm_1p and model.normalization == "RMSNorm"
    assert llama3.logging.profile and (
        llama3.logging.profile_step_start,
        llama3.logging.profile_step_end,
    ) == (4, 6)
    assert (llama3.tokenizer.tiktoken_pattern, llama3.checkpoint.ckpt_format, llama3.data.split) == (
        "v2",
        "torch_dist",
        "'99,1,0'",
    )


@pytest.mark.processes
@pytest.mark.skipif(
    __import__("torch").cuda.is_available() and __import__("torch").cuda.get_device_capability() >= (8, 9),
    reason="this machine has an FP8 GPU",
)
def test_fp8_flags_are_refused_naming_the_flag(llama3_argv, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(llama3_argv, world_size=8)
    error = capsys.readouterr().err
    assert "--fp8-format asks for FP8 training, which needs an FP8 GPU (compute capability 8.9+" in error
    assert "drop the --fp8-format --fp8-amax-history-len --fp8-amax-compute-algo --fp8-param-gather" in error


@pytest.mark.processes
def test_accepted_only_flags_log_what_they_mean_here(llama3_argv, caplog) -> None:
    caplog.set_level("INFO", logger="megatron_train.arguments")
    parse_args(without(llama3_argv, *FP8_FLAGS), world_size=8)
    kernels = ["--transformer-impl", "local", "--distributed-backend", "gloo", "--no-masked-softmax-fusion"]
    parse_args([*without(llama3_argv, *FP8_FLAGS), *kernels], world_size=8)
    notes = {record.getMessage().split(":")[0] for record in caplog.records}
    assert {
        "--use-mcore-models",
        "--attention-backend fused",
        "--cross-entropy-loss-fusion",
        "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files",
        "--log-throughput",
        "--transformer-impl local",
        "--distributed-backend gloo",
        "--no-masked-softmax-fusion",
    } <= notes
    assert not {"--ckpt-format torch_dist", "--context-parallel-size 1"} & notes  # implemented: no note


def _tiny_gpt2_files(directory: Path) -> tuple[str, str, str]:
    """A byte-level BPE vocab/merges and a .bin/.idx of counting documents in its ids."""
    texts = [" ".join(str(i + j) for j in range(40)) for i in range(200)]
    files = train_byte_level_bpe(texts, str(directory), vocab_size=300, min_frequency=1)
    return files["vocab_file"], files["merge_file"], _counting_documents(directory, 256)


def _counting_documents(directory: Path, vocab_size: int) -> str:
    """A .bin/.idx of 4000 documents counting up (mod `vocab_size`) from random ids; returns its prefix."""
    prefix = str(directory / "data_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(4000):  # --split 949,50,1 must leave the test split a few documents
        start = rng.integers(0, 200)
        builder.add_item((start + np.arange(rng.integers(8, 40))) % vocab_size)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.processes
def test_tiny_gpt3_example_trains_on_two_pipeline_stages(tmp_path) -> None:
    vocab, merges, data = _tiny_gpt2_files(tmp_path)
    save = str(tmp_path / "ckpt")
    argv = example_argv(GPT3, tmp_path, save, str(tmp_path / "tb"), vocab, merges, data)
    argv = override(
        argv,
        {
            "--num-layers": "2", "--hidden-size": "32", "--num-attention-heads": "4", "--seq-length": "16",
            "--max-position-embeddings": "16", "--global-batch-size": "4",
            "--step-batch-size-schedule": "0:2 32:4",  # tokens: from 2 samples on, batches of 4
            "--train-iters": "3", "--lr-decay-iters": "3", "--tensor-model-parallel-size": "1",
            "--pipeline-model-parallel-size": "2", "--log-interval": "1", "--save-interval": "2",
            "--eval-interval": "2", "--eval-iters": "1",
        },
    )  # fmt: skip
    # fp16's default first loss scale 2^32 overflows (and skips) the first steps, as in Megatron: start lower.
    extra = ["--num-workers", "0", "--initial-loss-scale", "1024"]
    (records,) = run_distributed(pretrain_worker, 2, [[*argv, *extra]])[-1]
    steps = [r for r in records if "split" not in r]
    assert [(r["iteration"], r["consumed samples"], r["global batch size"]) for r in steps] == [
        (1, 2, 2),
        (2, 6, 4),
        (3, 10, 4),
    ]
    assert all(r["lm loss"] > 0 and r["number of skipped iterations"] == 0 for r in steps)
    assert [r["split"] for r in records if "split" in r] == ["valid", "valid", "test"]
    assert read_latest_iteration(save) == 3


@pytest.mark.processes
def test_tiny_llama3_example_trains_with_every_flag_but_fp8(tmp_path) -> None:
    save, tensorboard = tmp_path / "ckpt", tmp_path / "tb"
    argv = without(example_argv(LLAMA3, tmp_path, str(save), str(tensorboard)), *FP8_FLAGS)
    argv = override(
        argv,
        {
            "--num-layers": "2", "--hidden-size": "32", "--ffn-hidden-size": "64", "--num-attention-heads": "4",
            "--num-query-groups": "2", "--kv-channels": "8", "--seq-length": "16",
            "--max-position-embeddings": "16", "--global-batch-size": "4", "--train-samples": "12",
            "--lr-decay-samples": "12", "--lr-warmup-samples": "4", "--vocab-size": "128", "--eval-iters": "1",
            "--eval-interval": "2", "--save-interval": "3", "--profile-step-start": "1",
            "--profile-step-end": "2",
            "--num-workers": "0",  # the test harness's ranks are daemonic processes: no loader workers
        },
    )  # fmt: skip
    (records,) = run_distributed(pretrain_worker, 2, [argv])[-1]
    steps = [r for r in records if "split" not in r]
    assert [r["iteration"] for r in steps] == [1, 2, 3]
    assert all(np.isfinite(r["lm loss"]) for r in steps)
    # NullTokenizer's 128 ids + eod (padded to 256 logits, the padding masked out of the softmax): at init the
    # per-token mean loss is about ln(129).
    assert steps[0]["lm loss"] == pytest.approx(np.log(129), rel=0.02)
    assert len(glob.glob(str(tensorboard / "rank0.*.pt.trace.json"))) == 1  # --profile, rank 0 only


# -- the README's commands since 2020 and the example scripts at f2e72c8a16^ ----------------------------------------

OLD_SCRIPTS = sorted((FIXTURES / "e70f83123f").glob("*.sh"))  # examples/ at f2e72c8a16^ (commit e70f83123f)
README_COMMANDS = json.loads((FIXTURES / "readme_commands.json").read_text())
PARSERS = {  # Megatron's entry point -> the parser of ours that takes its command line
    "pretrain_gpt": build_parser,
    "pretrain_bert": build_parser,
    "pretrain_t5": build_parser,
    "tasks.main": tasks_main.build_parser,
    "run_text_generation_server": text_generation_server.build_parser,
    "checkpoint_util": checkpoint_util.build_parser,
    "preprocess_data": tokenize_stage.build_parser,
}


def megatron_commands() -> list[tuple[str, str, list[str]]]:
    """(where, entry point, argv) of every README command and every command of the old example scripts."""
    commands = [
        (f"README.md@{c['first_commit']} ({c['first_date']} to {c['last_date']})", c["entry"], c["argv"])
        for c in README_COMMANDS
    ]
    for script in OLD_SCRIPTS:
        commands += [
            (f"examples/{script.name}", entry, argv) for entry, argv in shell_commands(script.read_text())
        ]
    return commands


def test_every_flag_of_megatrons_readme_commands_and_old_example_scripts_is_listed_by_our_help() -> None:
    commands = megatron_commands()
    assert len(OLD_SCRIPTS) == 15 and len(commands) >= 60
    assert {entry for _, entry, _ in commands} == set(PARSERS)
    helps = {entry: parser().format_help() for entry, parser in PARSERS.items()}
    unlisted = sorted(
        f"{where}: {entry} {flag}"
        for where, entry, argv in commands
        for flag in flag_names(argv)
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[entry])
    )
    assert unlisted == []


def test_renamed_flags_are_read_as_their_successors_with_one_deprecation_line(tmp_path, caplog) -> None:
    caplog.set_level("WARNING", logger="megatron_train.legacy_flags")
    base = [*tiny_args(str(tmp_path), "--train-iters", "2")]

    def parsed(*old: str):
        caplog.clear()
        config = parse_args([*base, *old], world_size=1)
        return config, [record.getMessage() for record in caplog.records]

    config, notices = parsed(
        "--activations-checkpoint-method", "block", "--activations-checkpoint-num-layers", "2"
    )
    model = config.model
    assert (model.recompute_granularity, model.recompute_method, model.recompute_num_layers) == (
        "full",
        "block",
        2,
    )
    assert notices == [
        "--activations-checkpoint-method block is deprecated (Megatron renamed it): read as --recompute-granularity "
        "full --recompute-method block (--recompute-num-layers 1 unless given)",
        "--activations-checkpoint-num-layers 2 is deprecated (Megatron renamed it): read as --recompute-num-layers 2",
    ]
    config, notices = parsed(
        "--checkpoint-activations", "--DDP-impl", "torch", "--use-rotary-position-embeddings"
    )
    model = config.model
    assert (model.recompute_granularity, model.recompute_method, model.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )
    assert (config.training.ddp_impl, model.position_embedding_type) == ("torch", "rope")
    assert [line.split(" is deprecated")[0] for line in notices] == [
        "--checkpoint-activations", "--DDP-impl torch", "--use-rotary-position-embeddings",
    ]  # fmt: skip
    # Megatron's rope scripts passed --no-position-embedding beside rope: it only drops the learned table
    assert parsed("--no-position-embedding")[0].model.position_embedding_type == "none"
    for both in (["--no-position-embedding", "--use-rotary-position-embeddings"],
                 ["--position-embedding-type", "rope", "--no-position-embedding"]):  # fmt: skip
        assert parsed(*both)[0].model.position_embedding_type == "rope"
    config, notices = parsed("--dataset-impl", "mmap", "--data-parallel-sharding-strategy", "no_shard")
    assert config.compat.dataset_impl == "mmap" and notices == []


@pytest.mark.parametrize(
    ("entry", "retired", "use"),
    [
        ("pretrain_gpt", ["--batch-size", "8"], "--micro-batch-size"),
        ("pretrain_bert", ["--warmup", "0.01"], "--lr-warmup-fraction"),
        ("pretrain_t5", ["--model-parallel-size", "2"], "--tensor-model-parallel-size"),
        ("pretrain_gpt", ["--intra-layer-model-parallel-size", "2"], "--tensor-model-parallel-size"),
        (
            "tasks.main",
            ["--batch-size", "8"],
            "--micro-batch-size",
        ),  # evaluate_zeroshot_gpt.sh at f2e72c8a16^
        ("run_text_generation_server", ["--warmup", "0.01"], "--lr-warmup-fraction"),
    ],
)
def test_retired_flags_are_listed_and_refused_naming_the_flag_to_use(entry, retired, use, capsys) -> None:
    parser = PARSERS[entry]()
    assert retired[0] in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(
            ["--load", "ckpt", "--task", "LAMBADA", *retired] if entry == "tasks.main" else retired
        )
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: {retired[0]} is no longer valid (Megatron retired it): use {use}" in error


def test_preprocess_data_and_checkpoint_util_take_their_old_spellings(tmp_path, capsys) -> None:
    argv = ["--input", "corpus.json", "--output-prefix", "out", "--tokenizer-type", "BertWordPieceLowerCase"]
    args = tokenize_stage.parse_args([*argv, "--vocab", "bert-vocab.txt", "--dataset-impl", "mmap"])
    assert args.vocab_file == "bert-vocab.txt"
    with pytest.raises(SystemExit):
        tokenize_stage.parse_args([*argv, "--dataset-impl", "lazy"])
    assert "argument --dataset-impl: invalid choice: 'lazy' (choose from 'mmap')" in capsys.readouterr().err
    # Megatron's README printed --target-pipeline-paralle-size from 2021 to 2023
    args = checkpoint_util.build_parser().parse_args(
        ["--load-dir", "a", "--save-dir", "b", "--target-pipeline-paralle-size", "2"]
    )
    assert args.target_pipeline_parallel_size == 2


# The Megatron flags of this issue beside the old ones: current in Megatron, missing here before.
ADDED_FLAGS = (
    "--embedding-weights-in-fp32", "--no-bias-gelu-fusion", "--use-checkpoint-args", "--log-params-norm",
    "--log-num-zeros-in-grad", "--dataset-impl", "--data-parallel-sharding-strategy",
)  # fmt: skip


@pytest.mark.parametrize(
    "main",
    [pretrain.main, pretrain_hybrid.main, pretrain_mamba.main, run_hybrid_text_generation_server.main],
    ids=["pretrain", "pretrain_hybrid", "pretrain_mamba", "run_hybrid_text_generation_server"],
)
def test_the_family_entry_points_take_the_old_and_added_flags(main, capsys) -> None:
    """The generic and hybrid entry points parse with the same parser: they list every old and added flag, and
    refuse a retired one in one line naming the flag to use."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    listed = capsys.readouterr().out
    flags = [legacy.flag for legacy in TRAINING_FLAGS] + list(ADDED_FLAGS)
    assert [flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", listed)] == []
    with pytest.raises(SystemExit):
        main(["--load", "ckpt", "--batch-size", "8"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith("error: --batch-size is no longer valid (Megatron retired it): use --micro-batch-size "
                          "(per rank) and --global-batch-size")  # fmt: skip


def _readme_command(entry: str, task: str | None = None) -> list[str]:
    """The README's command (2021-06 to 2023-06) for `entry` (and --task) with --activations-checkpoint-method."""
    (argv,) = [
        c["argv"] for c in README_COMMANDS
        if c["entry"] == entry and "--activations-checkpoint-method" in c["argv"]
        and (task is None or c["argv"][c["argv"].index("--task") + 1] == task)
    ]  # fmt: skip
    return argv


def readme_runs_worker(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> list:
    """Each (entry point, argv) run in turn in this process; what `main` returns."""
    from megatron_train import pretrain_bert, pretrain_gpt, pretrain_t5

    mains = {"pretrain_gpt": pretrain_gpt.main, "pretrain_bert": pretrain_bert.main, "pretrain_t5": pretrain_t5.main,
             "tasks.main": tasks_main.main}  # fmt: skip
    return [mains[entry](argv) for entry, argv in runs]


@pytest.mark.processes
def test_readme_commands_with_activations_checkpoint_method_uniform_run(tmp_path) -> None:
    """Sizes shrunk, data and checkpoint paths filled in, --num-workers 0 (the harness's ranks are daemonic) and
    fp16's first loss scale lowered (2^32 overflows the first steps, as in Megatron); every other flag kept."""
    vocab, merges, gpt_data = _tiny_gpt2_files(tmp_path)
    (tmp_path / "wordpiece").mkdir()
    # 1200 documents: --split 949,50,1 leaves the test split one
    bert_vocab, bert_data = write_wordpiece_corpus(tmp_path / "wordpiece", 1200)
    tiny = {"--num-layers": "2", "--hidden-size": "32", "--num-attention-heads": "4", "--max-position-embeddings": "32",
            "--log-interval": "1"}  # fmt: skip
    run = {**tiny, "--micro-batch-size": "2", "--global-batch-size": "4", "--train-iters": "2",
           "--lr-decay-iters": "2", "--save-interval": "2", "--eval-interval": "2", "--eval-iters": "1"}  # fmt: skip
    extra = ["--num-workers", "0", "--initial-loss-scale", "1024"]
    gpt = str(tmp_path / "gpt")
    runs = [
        ("pretrain_gpt", override(_readme_command("pretrain_gpt"), {
            **run, "--seq-length": "16", "--max-position-embeddings": "16", "--vocab-file": vocab, "--merge-file": merges,
            "--data-path": gpt_data, "--save": gpt, "--load": gpt})),
        ("pretrain_bert", override(_readme_command("pretrain_bert"), {
            **run, "--seq-length": "32", "--vocab-file": bert_vocab, "--data-path": bert_data,
            "--save": str(tmp_path / "bert"), "--load": str(tmp_path / "bert")})),
        ("pretrain_t5", override(_readme_command("pretrain_t5"), {
            **run, "--kv-channels": "8", "--ffn-hidden-size": "64", "--encoder-seq-length": "32",
            "--decoder-seq-length": "16", "--vocab-file": bert_vocab, "--data-path": bert_data,
            "--save": str(tmp_path / "t5"), "--load": str(tmp_path / "t5")})),
    ]  # fmt: skip
    runs = [(entry, [*argv, *extra]) for entry, argv in runs]
    wiki = tmp_path / "wiki.test.tokens"
    wiki.write_text(" ".join(str(i % 97) for i in range(300)))
    lambada = tmp_path / "lambada_test.jsonl"
    lambada.write_text(
        "".join(json.dumps({"text": " ".join(str(i + j) for j in range(12))}) + "\n" for i in range(6))
    )
    for task, data in (("WIKITEXT103", wiki), ("LAMBADA", lambada)):
        argv = override(_readme_command("tasks.main", task), {
            **tiny, "--seq-length": "16", "--max-position-embeddings": "16", "--vocab-file": vocab,
            "--merge-file": merges, "--valid-data": str(data), "--load": gpt})  # fmt: skip
        runs.append(("tasks.main", argv))
    (results,) = run_distributed(readme_runs_worker, 1, runs, timeout=300)
    for name in ("gpt", "bert", "t5"):
        assert read_latest_iteration(str(tmp_path / name)) == 2, name
        metadata = json.loads(next((tmp_path / name).glob("iter_*/metadata.json")).read_text())
        model = metadata["args"]["model"]
        assert (model["recompute_granularity"], model["recompute_method"], model["recompute_num_layers"]) == (
            "full", "uniform", 1
        )  # fmt: skip
    wikitext, lambada_result = results[3:]
    assert wikitext["task"] == "WIKITEXT103" and np.isfinite(wikitext["ppl"])
    assert lambada_result["task"] == "LAMBADA" and 0.0 <= lambada_result["accuracy"] <= 1.0


@pytest.mark.parametrize("task", ["RACE", "MNLI"])
def test_readme_finetuning_commands_take_recompute_from_activations_checkpoint_method(task) -> None:
    args = tasks_main.build_parser().parse_args(_readme_command("tasks.main", task))
    model = finetune_config(args, saved=None).model
    assert (model.recompute_granularity, model.recompute_method, model.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )


MIXTRAL = "train_mixtral_8x7b_distributed.sh"


@pytest.mark.processes
def test_mixtral_example_parses_completely(tmp_path) -> None:
    """Megatron's Mixtral 8x7B script: 32 ranks (PP 4 x EP 8, DP 8 for the dense layers, expert DP 1)."""
    argv = example_argv(MIXTRAL, tmp_path, str(tmp_path / "ckpt"), "tokenizer.model", "data_text_document")
    parser = build_parser()
    assert [
        word for word in argv if word.startswith("--") and word not in parser._option_string_actions
    ] == []
    config = parse_args(argv, world_size=32)
    model, parallel = config.model, config.parallel
    assert (model.num_experts, model.moe_router_topk, model.moe_token_dispatcher_type) == (8, 2, "alltoall")
    assert (model.moe_grouped_gemm, model.moe_aux_loss_coeff, model.moe_ffn_hidden_size) == (
        True,
        [0.01],
        14336,
    )
    assert (parallel.expert_model_parallel_size, parallel.pipeline_model_parallel_size) == (8, 4)
    assert parallel.expert_data_parallel_size(32) == 1 and parallel.data_parallel_size(32) == 8
    assert config.training.overlap_param_gather and parallel.use_distributed_optimizer


def _tiny_sentencepiece(directory: Path) -> str:
    sentencepiece = pytest.importorskip("sentencepiece")
    lines = [" ".join(str(i + j) for j in range(30)) for i in range(300)]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(directory / "tiny"), vocab_size=200, model_type="unigram",
        character_coverage=1.0, minloglevel=2, num_threads=1,
    )  # fmt: skip
    return str(directory / "tiny.model")


@pytest.mark.processes
def test_tiny_mixtral_example_trains_its_experts_over_pipeline_and_expert_parallel_ranks(tmp_path) -> None:
    """Every flag of the script kept (bf16, grouped GEMM, alltoall, distributed optimizer with overlapped
    reduce and gather, Llama2Tokenizer), sizes shrunk: PP 2 x EP 2 on 4 ranks."""
    data = _counting_documents(tmp_path, 200)  # the ids of the SentencePiece model's 200 pieces
    save = tmp_path / "ckpt"
    argv = example_argv(MIXTRAL, tmp_path, str(save), _tiny_sentencepiece(tmp_path), data)
    argv = override(
        argv,
        {
            "--num-layers": "2", "--hidden-size": "32", "--ffn-hidden-size": "64", "--num-attention-heads": "4",
            "--num-query-groups": "2", "--seq-length": "16", "--max-position-embeddings": "16",
            "--num-experts": "4", "--global-batch-size": "4", "--train-iters": "2", "--lr-decay-iters": "2",
            "--lr-warmup-iters": "1", "--pipeline-model-parallel-size": "2", "--expert-model-parallel-size": "2",
            "--split": "90,8,2", "--eval-iters": "1", "--eval-interval": "1000",
        },
    )  # fmt: skip
    (records,) = run_distributed(pretrain_worker, 4, [[*argv, "--num-workers", "0"]])[-1]
    steps = [r for r in records if "split" not in r]
    assert [r["iteration"] for r in steps] == [1, 2]
    assert all(np.isfinite(r["lm loss"]) and 0.9 < r["load_balancing_loss"] < 4 for r in steps)
    assert read_latest_iteration(str(save)) == 2
