"""`flows.pretrain --model bert|t5|gpt`: BERT and T5 get sentence-split WordPiece data and their own entry point;
a tiny BERT (and T5) trains end to end on the embedded corpus under Prefect, then the rerun is all cache hits."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

import megatron_train
from flows.corpus import CorpusConfig
from flows.failures import StageFailed
from flows.pretrain import PretrainFlowConfig, corpus_for_model, parse, pretrain_flow
from megatron_train.families import get_family
from stages.download import EMBEDDED_CORPUS, DownloadParams
from stages.pretrain import corpus_families, params_from_argv, run_directory, torchrun_command
from stages.tokenize import TokenizeParams
from stages.train_tokenizer import TrainTokenizerParams
from storage.artifacts import ArtifactStore

TINY_BERT = (
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "4",
    "--train-iters", "6", "--lr", "1e-3", "--split", "90,10,0", "--eval-interval", "1000", "--eval-iters", "1",
    "--log-interval", "1", "--seed", "7",
)  # fmt: skip


@pytest.mark.parametrize("model", ["bert", "t5"])
def test_bert_and_t5_read_sentence_split_wordpiece_data(model):
    corpus = corpus_for_model(CorpusConfig(), model)
    assert corpus.tokenize.tokenizer_type == "BertWordPieceLowerCase" and corpus.tokenize.vocab_file is None
    assert corpus.tokenize.split_sentences and not corpus.tokenize.append_eod
    assert corpus.train_tokenizer == TrainTokenizerParams(kind="wordpiece", vocab_size=8192)
    given = CorpusConfig(tokenize=TokenizeParams(tokenizer_type="BertWordPieceCase", vocab_file="vocab.txt"))
    kept = corpus_for_model(given, model).tokenize
    assert (kept.tokenizer_type, kept.vocab_file, kept.split_sentences) == (
        "BertWordPieceCase",
        "vocab.txt",
        True,
    )
    assert corpus_for_model(CorpusConfig(), "gpt") == CorpusConfig()


def test_each_model_launches_its_entry_point():
    assert parse(["--model", "bert"]).model == "bert" and parse([]).model == "gpt"
    params = params_from_argv(TINY_BERT)
    modules = {}
    for model in corpus_families():
        command = torchrun_command(params.config, 1, model)
        modules[model] = command[command.index("-m", 3) + 1]
    assert modules == {
        "gpt": "megatron_train.pretrain_gpt",
        "bert": "megatron_train.pretrain_bert",
        "t5": "megatron_train.pretrain_t5",
        "hybrid": "megatron_train.pretrain_hybrid",
    }
    with pytest.raises(ValueError, match="model family 'bart' is neither one of this project's"):
        params_from_argv(TINY_BERT, model="bart")


# What each family adds to TINY_BERT, and the losses its runs log.
FAMILY_ARGS = {"bert": (), "t5": ("--encoder-seq-length", "64", "--decoder-seq-length", "32")}
FAMILY_LOSSES = {"bert": ("lm loss", "sop loss"), "t5": ("lm loss",)}


@pytest.mark.processes
@pytest.mark.parametrize("model", ["bert", "t5"])
def test_pretrain_flow_end_to_end_then_cached(prefect_api_url, tmp_path, model):
    module = get_family(model).entry_module
    entry_point = Path(megatron_train.__file__).parent / f"{module.split('.')[-1]}.py"
    if (
        not entry_point.exists()
    ):  # looked up in this tree: the shared venv's editable install may hold another
        pytest.skip(f"{module} is not in this tree")
    with lzma.open(EMBEDDED_CORPUS, "rt") as f:
        chapters = [json.loads(line) for _, line in zip(range(60), f, strict=False)]
    source = tmp_path / "kjv60.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in chapters))
    config = PretrainFlowConfig(
        corpus=CorpusConfig(
            store=str(tmp_path / "store"),
            download=DownloadParams(source=str(source), docs_per_shard=30),
            train_tokenizer=TrainTokenizerParams(vocab_size=1024),
            tokenize=TokenizeParams(workers=1),
            task_runner="threads",
        ),
        model=model,
        megatron_args=(*TINY_BERT, *FAMILY_ARGS[model]),
        nproc_per_node=1,
        save_interval=3,
    )
    refs = pretrain_flow(config)
    store = ArtifactStore(str(tmp_path / "store"))
    tokenizer = store.ref(refs["train_tokenizer"]).manifest()["tokenizer"]
    assert tokenizer["tokenizer_type"] == "BertWordPieceLowerCase"
    assert store.ref(refs["tokenize"]).manifest()["outputs"]["text"].endswith("_text_sentence")
    run = run_directory(store.ref(refs["pretrain"]))
    records = [json.loads(line) for line in Path(run, "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "split" not in r]
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(r[key] > 0 for r in steps for key in FAMILY_LOSSES[model])
    metadata = json.loads(Path(run, "iter_0000006", "metadata.json").read_text())
    assert metadata["model_type"] == model
    again = pretrain_flow(config)
    assert again["pretrain"]["url"] == refs["pretrain"]["url"] and again["pretrain"]["cache_hit"]
    if model == "bert":
        _changed_token_data_is_refused_then_rebuilt(config, refs, Path(run))


def _changed_token_data_is_refused_then_rebuilt(config: PretrainFlowConfig, refs: dict, run: Path) -> None:
    """The token data handed to torchrun changed after its commit: a (re)training refuses it before launching,
    naming the file and the stage to rebuild; --rebuild tokenize gives the same tokens and the same model."""
    tokenized = ArtifactStore(config.corpus.store).ref(refs["tokenize"])
    data = Path(tokenized.local_path(tokenized.manifest()["outputs"]["text"] + ".bin"))
    original, weights = (
        data.read_bytes(),
        (run / "iter_0000006" / "mp_rank_00" / "model.safetensors").read_bytes(),
    )
    changed = bytearray(original)
    changed[len(changed) // 2] ^= 0x01
    data.chmod(0o644)
    data.write_bytes(bytes(changed))

    def rebuilding(*stages: str) -> PretrainFlowConfig:
        return config.model_copy(update={"corpus": config.corpus.model_copy(update={"rebuild": stages})})

    with pytest.raises(StageFailed) as refused:
        pretrain_flow(rebuilding("pretrain"))
    assert str(refused.value) == (
        f"the pretrain stage failed: {data}: its content differs from its manifest's hash; the tokenize artifact "
        f"{tokenized.url} changed after it was committed: rebuild it (--rebuild tokenize)"
    )
    assert run.is_dir()  # refused before the committed run was discarded
    recovered = pretrain_flow(rebuilding("tokenize"))
    assert recovered["tokenize"]["rebuilt"] and recovered["pretrain"]["rebuilt"]  # and what follows it
    assert recovered["pretrain"]["key"] == refs["pretrain"]["key"] and data.read_bytes() == original
    assert (run / "iter_0000006" / "mp_rank_00" / "model.safetensors").read_bytes() == weights
