"""pretrain_retro on a Retro project: RetroDataset samples, the project's settings, layouts (TP=2 + SP, DP=2 +
distributed optimizer) equal to one process, bitwise resume, bf16, retro-fitting a GPT checkpoint with the
decoder frozen, and generation with retrieval from a saved Retro checkpoint."""

from __future__ import annotations

import dataclasses
import glob
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_train.arguments import config_to_argv, parse_args
from megatron_train.checkpointing import SavedCheckpoint, load_model_for_inference
from megatron_train.data import DataConfig, build_train_valid_test_datasets
from megatron_train.data.retro_dataset import RetroDataset
from megatron_train.inference.generation import GenerationParams, allocate_kv_cache, generate
from megatron_train.models.retro import RetroKVCache, RetroModel
from megatron_train.pretrain_retro import main
from megatron_train.tokenizer.null import NullTokenizer
from retro.db import ChunkDatabase
from retro.family import datasets_provider, with_project_settings
from retro.project import db_dir
from retro.query import load_neighbours
from retro.retrieval import Retriever, RetrievingModel, complete_chunks, generate_with_retrieval
from stages.retro_pretrain import STAGE, RetroPretrainParams, retro_argv, run_config
from tests.helpers.distributed import run_distributed
from tests.helpers.retro_project import (
    CHUNK_LENGTH,
    EOD,
    NUM_SAVED_NEIGHBOURS,
    SEQ_LENGTH,
    VOCAB_SIZE,
    bag_of_tokens,
    build_project,
    twin_documents,
)
from tests.helpers.training import ROOT, read_marker, read_metrics

QUIET = ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--retro-encoder-hidden-dropout", "0.0",
         "--retro-encoder-attention-dropout", "0.0"]  # fmt: skip


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("retro_project"))
    build_project(directory, twin_documents(100), train_samples=64, global_batch_size=4)
    return directory


DROPOUT = ["--train-iters", "6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def retro_args(project_dir: str, save: str, *extra: str) -> list[str]:
    return [
        "--retro-project-dir", project_dir, "--retro-add-retriever", "--num-layers", "6", "--hidden-size", "32",
        "--num-attention-heads", "4", "--vocab-size", str(VOCAB_SIZE), "--micro-batch-size", "2", "--lr", "3e-3",
        "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.2", "--log-interval", "1", "--num-workers", "0",
        "--save", save, "--load", save, "--train-iters", "4", *extra,
    ]  # fmt: skip


def retro_worker(rank: int, world_size: int, runs: list[list[str]]) -> list[list[dict]]:
    """Run pretrain_retro once per argv in this process group; each run's metrics (last rank)."""
    results = []
    for argv in runs:
        main(argv)
        save = argv[argv.index("--save") + 1]
        results.append(read_metrics(save) if rank == world_size - 1 else [])
    return results


def _train(records: list[dict]) -> list[float]:
    return [r["lm loss"] for r in records if "split" not in r]


def test_retro_dataset_returns_the_neighbours_tokens_from_the_database(project):
    gpt = build_train_valid_test_datasets(
        DataConfig(data_path=[os.path.join(project, "data", "corpus")], split="90,10,0"),
        SEQ_LENGTH, (64, 4, 4), 7, EOD, VOCAB_SIZE + 1,
    )[0]  # fmt: skip
    neighbours = load_neighbours(os.path.join(project, "query", "train"))
    neighbours[5, 1] = -1  # a neighbour the query did not find
    db = ChunkDatabase(db_dir(project))
    dataset = RetroDataset(gpt, neighbours, db, SEQ_LENGTH, CHUNK_LENGTH, 2, 2, EOD)
    chunks = SEQ_LENGTH // CHUNK_LENGTH
    assert len(dataset) == len(gpt) and len(neighbours) == len(gpt) * chunks
    short = np.flatnonzero(db.chunks[:, 3] - db.chunks[:, 2] < CHUNK_LENGTH)
    checked_short = 0
    for idx in range(len(dataset)):
        sample = dataset[idx]
        np.testing.assert_array_equal(sample["tokens"], gpt[idx]["tokens"])
        assert sample["neighbor_tokens"].shape == (chunks, 2, 2 * CHUNK_LENGTH)
        for chunk in range(chunks):
            for k in range(2):
                neighbour = int(neighbours[idx * chunks + chunk, k])
                tokens = sample["neighbor_tokens"][chunk, k]
                if neighbour < 0:
                    assert (tokens == EOD).all()
                    continue
                for i, chunk_id in enumerate((neighbour, (neighbour + 1) % len(db))):
                    expected = np.full(CHUNK_LENGTH, EOD)
                    dataset_idx, doc, start, end, _ = db.chunks[chunk_id]
                    expected[: end - start] = db.datasets[dataset_idx].get(int(doc))[start:end]
                    np.testing.assert_array_equal(tokens[i * CHUNK_LENGTH : (i + 1) * CHUNK_LENGTH], expected)
                    checked_short += chunk_id in short
    assert checked_short > 0  # short chunks (a document's last) were checked, padded with EOD
    assert (dataset[1]["neighbor_tokens"][1, 1] == EOD).all()  # row 5 = sample 1, chunk 1


def test_retro_dataset_refuses_neighbours_of_other_samples(project):
    gpt = build_train_valid_test_datasets(
        DataConfig(data_path=[os.path.join(project, "data", "corpus")], split="90,10,0"),
        SEQ_LENGTH, (64, 4, 4), 7, EOD, VOCAB_SIZE + 1,
    )[0]  # fmt: skip
    neighbours = load_neighbours(os.path.join(project, "query", "train"))
    db = ChunkDatabase(db_dir(project))
    with pytest.raises(ValueError, match="cover 4 chunks but the .* samples have"):
        RetroDataset(gpt, neighbours[:4], db, SEQ_LENGTH, CHUNK_LENGTH, 2, 2, EOD)
    with pytest.raises(ValueError, match="--retro-num-neighbors 4 exceeds the 3 neighbours saved"):
        RetroDataset(gpt, neighbours, db, SEQ_LENGTH, CHUNK_LENGTH, NUM_SAVED_NEIGHBOURS + 1, 2, EOD)


def test_the_project_fixes_the_data_settings(project, tmp_path):
    argv = with_project_settings(retro_args(project, str(tmp_path)))
    for flag, value in (("--seq-length", "16"), ("--retro-chunk-length", "4"), ("--split", "90,10,0"),
                        ("--seed", "7"), ("--tokenizer-type", "NullTokenizer"), ("--global-batch-size", "4")):  # fmt: skip
        assert argv[argv.index(flag) + 1] == value
    assert argv[argv.index("--data-path") + 1] == os.path.join(project, "data", "corpus")
    assert "--train-samples" not in argv  # the run gave --train-iters
    assert with_project_settings(
        [*retro_args(project, str(tmp_path)), "--seq-length", "16"]
    )  # repeating: fine
    retro_flags = [
        "--retro-fit-freeze-decoder",
        "--retro-no-verify-neighbor-count",
        "--retro-num-neighbors",
        "3",
    ]
    config = parse_args(with_project_settings([*retro_args(project, str(tmp_path)), *retro_flags]), 1)
    assert config.retro.retro_fit_freeze_decoder and not config.retro.retro_verify_neighbor_count
    assert (config.retro.retro_num_neighbors, config.retro.retro_chunk_length) == (3, CHUNK_LENGTH)
    assert parse_args(config_to_argv(config), 1) == config  # how the pretrain stage launches a run
    for flag, value in (("--seq-length", "32"), ("--retro-chunk-length", "8"), ("--seed", "8"),
                        ("--data-path", str(tmp_path / "other"))):  # fmt: skip
        with pytest.raises(ValueError, match=f"{flag} .* differs from the Retro project's"):
            with_project_settings([*retro_args(project, str(tmp_path)), flag, value])


def test_pipeline_parallel_and_unqueried_samples_are_refused(project, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="Retro does not support pipeline parallelism"):
        main([*retro_args(project, str(tmp_path)), "--pipeline-model-parallel-size", "2"])
    config = parse_args(with_project_settings(retro_args(project, str(tmp_path))), world_size=1)
    with pytest.raises(
        ValueError,
        match="reads 400 train samples but the Retro project .*config.json queried neighbours for 64",
    ):
        datasets_provider(config, NullTokenizer(VOCAB_SIZE), (400, 4, 4))
    # the stage checks before it launches: 4 steps evaluated every 2 read 3 x 4 validation samples, 4 queried
    flags = tuple(retro_args(project, "unused")[3:-6])  # the model flags, without the project and checkpoints
    assert run_config(
        RetroPretrainParams(flags=(*flags, "--train-iters", "4")), project, str(tmp_path / "run")
    )
    with pytest.raises(ValueError, match="reads 12 valid samples .* lower --eval-interval/--eval-iters"):
        evaluated = RetroPretrainParams(flags=(*flags, "--train-iters", "4", "--eval-interval", "2"))
        run_config(evaluated, project, str(tmp_path / "run"))


def test_runs_started_from_a_gpt_run_add_the_fit_flags(project, tmp_path):
    """The Retro flow's retro-fitted Retro and its baseline (the GPT continued as long) both start from the GPT
    run's checkpoint with the `fit_flags`; the GPT they start from has only the `flags`."""
    flags = tuple(retro_args(project, "unused")[3:-6])
    params = RetroPretrainParams(
        flags=(*flags, "--train-iters", "2"),
        fit_flags=("--train-iters", "4"),
        retro_flags=("--retro-num-neighbors", "1"),
        retriever=False,
    )
    run = str(tmp_path / "run")
    assert run_config(params, project, run).training.train_iters == 2
    continued = run_config(params, project, run, retro_fit_from=str(tmp_path / "gpt"))
    assert continued.training.train_iters == 4 and continued.checkpoint.finetune
    assert not continued.retro.retro_add_retriever and "--retro-num-neighbors" not in retro_argv(
        params, project, run
    )
    fitted = run_config(dataclasses.replace(params, retriever=True), project, run, str(tmp_path / "gpt"))
    assert fitted.training.train_iters == 4 and fitted.retro.retro_num_neighbors == 1
    assert fitted.checkpoint.load == str(tmp_path / "gpt")
    # the flow runs both at once on half the cores each: the threads are not in the artifact's key
    assert STAGE.key_params(dataclasses.replace(params, threads=1)) == STAGE.key_params(params)


LAYOUTS = {  # name: (world size, flags); --use-cpu-initialization: every layout starts from the same weights
    "tp1": (1, []),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2-distopt": (2, ["--use-distributed-optimizer"]),
    "tp2-recompute": (2, ["--tensor-model-parallel-size", "2", "--recompute-granularity", "full",
                          "--recompute-method", "uniform", "--recompute-num-layers", "2"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(project, tmp_path_factory) -> dict[str, list[dict]]:
    """Every pretrain_retro run of this module, one process group per world size: name -> metrics."""
    tmp = tmp_path_factory.mktemp("retro_runs")
    single = {
        "tp1": [*QUIET, "--use-cpu-initialization"],
        "first": DROPOUT,
        "split": [*DROPOUT, "--exit-interval", "3"],
        "split-resumed": DROPOUT,
        "bf16": [*QUIET, "--bf16"],
        "gpt": ["--train-iters", "3"],  # no --retro-add-retriever: the baseline, here to retro-fit from
        "retrofit": ["--load", str(tmp / "gpt"), "--finetune", "--retro-fit-freeze-decoder", "--train-iters", "3",
                     "--save-interval", "1"],
        "retrofit-unfrozen": ["--load", str(tmp / "gpt"), "--finetune", "--train-iters", "2"],
    }  # fmt: skip
    saves = {name: str(tmp / name.removesuffix("-resumed")) for name in [*single, *LAYOUTS]}
    argvs = [retro_args(project, saves[name], *flags) for name, flags in single.items()]
    argvs[list(single).index("gpt")].remove("--retro-add-retriever")
    results = dict(zip(single, run_distributed(retro_worker, 1, argvs, timeout=600)[0], strict=True))
    pairs = {name: flags for name, (size, flags) in LAYOUTS.items() if size == 2}
    # the TP=1 GPT checkpoint retro-fitted at TP=2 + SP: its weights resharded, the decoder frozen
    pairs["retrofit-tp2-sp"] = [*LAYOUTS["tp2-sp"][1], *single["retrofit"][:4], "--train-iters", "2"]
    saves["retrofit-tp2-sp"] = str(tmp / "retrofit-tp2-sp")
    argvs = [
        retro_args(project, saves[name], *QUIET, "--use-cpu-initialization", *f) for name, f in pairs.items()
    ]
    results.update(zip(pairs, run_distributed(retro_worker, 2, argvs, timeout=600)[-1], strict=True))
    return {**results, **{f"{name}-dir": save for name, save in saves.items()}}


@pytest.mark.processes
@pytest.mark.parametrize("name", [name for name in LAYOUTS if name != "tp1"])
def test_retro_layouts_log_the_losses_of_one_process(runs, name):
    reference = _train(runs["tp1"])
    assert len(reference) == 4 and len(set(reference)) == 4
    np.testing.assert_allclose(_train(runs[name]), reference, rtol=1e-5, err_msg=name)


@pytest.mark.processes
def test_retro_resumes_bitwise(runs):
    reference = _train(runs["first"])
    assert len(reference) == 6 and len(set(reference)) == 6
    assert _train(runs["split"]) == reference[:3]
    assert _train(runs["split-resumed"]) == reference  # metrics.jsonl holds the whole history


@pytest.mark.processes
def test_retro_killed_mid_run_resumes_with_the_same_losses(runs, project, tmp_path):
    """`python -m megatron_train.pretrain_retro` SIGKILLed after its iteration-4 checkpoint, then rerun: the losses
    are bit for bit those of the uninterrupted run (dropout on: the RNG states resume too)."""
    save = str(tmp_path / "killed")
    argv = [sys.executable, "-m", "megatron_train.pretrain_retro",
            *retro_args(project, save, *DROPOUT, "--save-interval", "2")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    popen = dict(cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with subprocess.Popen(argv, **popen) as proc:
        for line in proc.stdout:
            if line.startswith(" iteration        5/"):
                proc.send_signal(signal.SIGKILL)
                break
        proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL and read_marker(save) == 4
    finished = subprocess.run(argv, **popen, timeout=300)
    assert finished.returncode == 0, finished.stdout
    assert _train(read_metrics(save)) == _train(runs["first"])


@pytest.mark.processes
def test_retro_trains_in_bf16(runs):
    losses = _train(runs["bf16"])
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert abs(losses[0] - _train(runs["tp1"])[0]) < 0.1


@pytest.mark.processes
def test_the_gpt_baseline_trains_on_the_same_samples_without_retrieval(runs):
    metadata = SavedCheckpoint(glob.glob(os.path.join(runs["gpt-dir"], "iter_*"))[-1]).metadata
    assert metadata["model_type"] == "gpt" and len(_train(runs["gpt"])) == 3
    assert not metadata["args"]["retro"]["retro_add_retriever"]


def _weights(save: str, iteration: int) -> dict[str, torch.Tensor]:
    saved = SavedCheckpoint(os.path.join(save, f"iter_{iteration:07d}"))
    return {name: saved.global_tensor(name, "model", saved.padded_vocab_size) for name in saved.params}


@pytest.mark.processes
def test_retro_fitting_starts_from_the_gpt_decoder_and_freezing_keeps_it(runs, project, tmp_path):
    """Also when the TP=1 GPT checkpoint is retro-fitted at TP=2 with sequence parallelism."""
    gpt = _weights(runs["gpt-dir"], 3)
    frozen = {iteration: _weights(runs["retrofit-dir"], iteration) for iteration in (1, 3)}
    frozen_tp2 = _weights(runs["retrofit-tp2-sp-dir"], 2)
    unfrozen = _weights(runs["retrofit-unfrozen-dir"], 2)
    retro_names = [name for name in frozen[3] if name not in gpt]
    assert retro_names and all(
        ".cross_attention." in n or ".pre_cross_attn_layernorm." in n for n in retro_names
    )
    assert set(gpt) <= set(frozen[3])
    for name, tensor in gpt.items():  # the decoder keeps the GPT checkpoint's weights, bit for bit
        assert torch.equal(frozen[3][name], tensor), name
        assert torch.equal(frozen_tp2[name][: len(tensor)], tensor), name  # TP=2 pads the vocabulary further
    moved = [name for name in retro_names if not torch.equal(frozen[1][name], frozen[3][name])]
    assert len(moved) == len(retro_names)  # while every Retro weight trains
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(unfrozen[fc1], gpt[fc1])  # without the flag the decoder trains too
    assert [r["iteration"] for r in runs["retrofit"] if "split" not in r] == [1, 2, 3]  # --finetune: from 0
    with pytest.raises(SystemExit, match="holds a GPT checkpoint .* pass --finetune to retro-fit"):
        main([*retro_args(project, str(tmp_path)), "--load", runs["gpt-dir"]])


def test_retrieval_cuts_text_into_the_training_chunks():
    assert complete_chunks(8, 4) == [(0, 4), (4, 8)]
    assert complete_chunks(10, 4) == [(0, 4), (4, 8)]  # the chunk being written is not retrieved for yet
    assert complete_chunks(3, 4) == []


@pytest.mark.processes
def test_generation_retrieves_for_the_text_so_far_from_a_saved_retro_checkpoint(runs, project):
    model, config = load_model_for_inference(runs["tp1-dir"], device="cpu")
    assert isinstance(model, RetroModel) and config.retro.retro_chunk_length == CHUNK_LENGTH
    tokenizer = NullTokenizer(VOCAB_SIZE)
    retriever = Retriever.from_project(project, model, bag_of_tokens, tokenizer, nprobe=1, ef_search=1)
    db = ChunkDatabase(db_dir(project))
    document = next(d for d in map(db.datasets[0].get, range(50)) if len(d) > 2 * CHUNK_LENGTH)
    prompt = document[: 2 * CHUNK_LENGTH].tolist()  # the document's first two database chunks
    ids = retriever.neighbour_ids([prompt[:CHUNK_LENGTH], prompt[CHUNK_LENGTH:]])
    assert ids.shape == (2, 2)
    for chunk, found in enumerate(ids):  # found as itself or as its twin: the same tokens
        np.testing.assert_array_equal(
            db.chunk_tokens(int(found[0])), prompt[chunk * CHUNK_LENGTH :][:CHUNK_LENGTH]
        )
    prompt = document[: 2 * CHUNK_LENGTH + 1].tolist()  # two complete chunks and one being written
    neighbours = retriever(prompt)
    assert neighbours.shape == (2, 2, 2 * CHUNK_LENGTH)
    generated = generate_with_retrieval(model, retriever, prompt, 4)
    assert 1 <= len(generated) <= 4
    # the model runs on whole chunks: the prompt padded, the chunk being written without neighbours yet
    padded = torch.tensor([prompt + [EOD] * (CHUNK_LENGTH - 1)])
    open_chunk = np.full((1, 2, 2 * CHUNK_LENGTH), EOD)
    logits = model(padded, neighbor_tokens=torch.as_tensor(np.concatenate([neighbours, open_chunk]))[None])
    assert int(logits[0, len(prompt) - 1].argmax()) == generated[0]


@pytest.mark.processes
def test_generation_with_the_kv_cache_gives_the_tokens_of_generation_without(runs, project):
    """The cached decoder (new tokens only, each chunk's neighbours encoded once) gives the logits of the whole
    text run again, prompt lengths inside, at and across chunk ends, alone and in a batch of unequal prompts."""
    model, _ = load_model_for_inference(runs["tp1-dir"], device="cpu")
    tokenizer = NullTokenizer(VOCAB_SIZE)
    retriever = Retriever.from_project(project, model, bag_of_tokens, tokenizer, nprobe=1, ef_search=1)
    retrieving = RetrievingModel(model, retriever).eval()
    db = ChunkDatabase(db_dir(project))
    text = np.concatenate([db.datasets[0].get(i)[:-1] for i in range(6)])[: SEQ_LENGTH - 1].tolist()
    with torch.no_grad():
        whole = retrieving(torch.tensor([text]))
        cache = allocate_kv_cache(retrieving, 1, len(text))
        steps = [retrieving(torch.tensor([text[:5]]), kv_cache=cache)]
        steps += [retrieving(torch.tensor([text[i : i + 1]]), kv_cache=cache) for i in range(5, len(text))]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-5, atol=1e-5)
    assert (
        isinstance(cache, RetroKVCache) and len(cache.contexts) == len(text) // CHUNK_LENGTH
    )  # each complete chunk encoded once
    for length in (1, CHUNK_LENGTH - 1, CHUNK_LENGTH, 2 * CHUNK_LENGTH + 1):
        cached = generate_with_retrieval(model, retriever, text[:length], 6)
        assert cached == generate_with_retrieval(model, retriever, text[:length], 6, use_kv_cache=False)
    prompts = [" ".join(map(str, text[:3])), " ".join(map(str, text[:9]))]
    params = GenerationParams(tokens_to_generate=6, top_k=1)
    batched = generate(retrieving, tokenizer, prompts, params)
    assert (
        batched.tokens
        == generate(
            retrieving, tokenizer, prompts, GenerationParams(**{**params.__dict__, "use_kv_cache": False})
        ).tokens
    )
