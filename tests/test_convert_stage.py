"""The convert stage: a pretrain artifact (a trained run) to a Hugging Face folder that transformers loads with the
run's logits and tokenizer; cached on rerun; a failed conversion leaves no artifact and the rerun completes."""

from __future__ import annotations

import json
import lzma
import os
from pathlib import Path

import pytest
import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.convert import ModelWeights, flow
from megatron_train.convert.weights import trim_vocab
from megatron_train.data.config import DataConfig
from megatron_train.models import GPTModel
from megatron_train.tokenizer.build import tokenizer_from_config
from megatron_train.training.config import TokenizerConfig
from stages import convert
from stages.convert import ConvertParams
from stages.download import EMBEDDED_CORPUS
from storage.artifacts import ArtifactRef, ArtifactStore
from tests.helpers.tiny import tiny_config

transformers = pytest.importorskip("transformers")
TEXT = "And God said, Let there be light: and there was light."


def _bpe_files(folder: Path) -> TokenizerConfig:
    """A byte-level BPE trained on a few KJV chapters, as the train_tokenizer stage writes it."""
    from tokenizers import ByteLevelBPETokenizer

    with lzma.open(EMBEDDED_CORPUS, "rt") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(5), f, strict=False)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=400, special_tokens=["<|endoftext|>"])
    folder.mkdir()
    bpe.save_model(str(folder))
    return TokenizerConfig(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(folder / "vocab.json"),
        merge_file=str(folder / "merges.txt"),
    )


def _pretrain_artifact(tmp_path: Path, store: ArtifactStore) -> tuple[ArtifactRef, GPTModel, TokenizerConfig]:
    """A committed pretrain artifact holding a tiny GPT's checkpoint (what the pretrain stage leaves), and the
    model itself."""
    tokenizer = _bpe_files(tmp_path / "tokenizer")
    vocab = tokenizer_from_config(tokenizer).vocab_size
    config = MegatronConfig(
        model=tiny_config(seq_length=64, true_vocab_size=vocab), data=DataConfig(), tokenizer=tokenizer
    )
    torch.manual_seed(5)
    model = GPTModel(config.model, 512).eval()
    run = tmp_path / "run"
    flow.save(ModelWeights(config, trim_vocab(model.state_dict(), vocab), iteration=30), str(run))
    writer = store.begin("pretrain", "a-trained-run")
    for path in sorted(p for p in run.rglob("*") if p.is_file()):
        writer.put_file(str(path), str(path.relative_to(run)))
    return writer.commit({"iteration": 30}), model, tokenizer


def test_run_to_hf_folder_loads_in_transformers_then_cached(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    pretrained, model, tokenizer_config = _pretrain_artifact(tmp_path, store)
    ref = convert.run(ConvertParams(), [pretrained], store)
    assert not ref.cache_hit and ref.key == convert.key(ConvertParams(), [pretrained])
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt"} <= set(ref.files())
    manifest = ref.manifest()
    assert manifest["format"] == "hf" and manifest["iteration"] == 30
    vocab = model.config.true_vocab_size
    assert manifest["counts"]["parameters"] == sum(
        t.numel() for t in trim_vocab(model.state_dict(), vocab).values()
    )

    folder = ref.local_path("config.json").rsplit("/", 1)[0]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ours = tokenizer_from_config(tokenizer_config)
    ids = ours.tokenize(TEXT)
    assert hf_tokenizer(TEXT)["input_ids"] == ids  # the run's tokenizer, under Hugging Face's names
    tokens = torch.tensor([ids])
    with torch.no_grad():
        expected = model(tokens)[..., :vocab]
        torch.testing.assert_close(hf_model(tokens).logits, expected, rtol=1e-5, atol=1e-5)

    before = {p: p.stat().st_mtime_ns for p in Path(folder).rglob("*")}
    again = convert.run(ConvertParams(), [pretrained], store)
    assert again.cache_hit and again.url == ref.url
    assert {p: p.stat().st_mtime_ns for p in Path(folder).rglob("*")} == before

    megatron = convert.run(
        ConvertParams(saver="megatron", target_tensor_parallel_size=2), [pretrained], store
    )
    assert megatron.key != ref.key
    assert {"latest_checkpointed_iteration.txt", "iter_0000030/mp_rank_01/model_optim_rng.pt"} <= set(
        megatron.files()
    )


def test_failed_conversion_commits_nothing_and_the_rerun_completes(tmp_path, monkeypatch):
    store = ArtifactStore(str(tmp_path / "store"))
    pretrained, _, _ = _pretrain_artifact(tmp_path, store)
    real = convert.convert_format

    def killed(*args, **kwargs):  # the files are written, then the process dies before they move
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "convert_format", killed)
    with pytest.raises(KeyboardInterrupt):
        convert.run(ConvertParams(), [pretrained], store)
    assert store.find("convert", convert.key(ConvertParams(), [pretrained])) is None
    monkeypatch.setattr(convert, "convert_format", real)
    ref = convert.run(ConvertParams(), [pretrained], store)
    assert not ref.cache_hit and json.loads(Path(ref.local_path("config.json")).read_text())["n_layer"] == 2
    assert not [
        p for p in (tmp_path / "store" / ".scratch").rglob("*") if p.is_file() and p.suffix != ".lock"
    ]


def test_the_run_s_own_format_is_refused_with_the_tool_to_use(tmp_path):
    with pytest.raises(
        ValueError, match=r"saver 'flow' is not one of hf, megatron, torch_dist.*checkpoint_util"
    ):
        convert.run(
            ConvertParams(saver="flow"),
            [ArtifactRef("pretrain", "k", str(tmp_path))],
            ArtifactStore(str(tmp_path / "store")),
        )
    assert os.listdir(tmp_path / "store") == []
