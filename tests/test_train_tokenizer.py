"""Tokenizer training (megatron_train/tokenizer/train.py) and the train_tokenizer stage."""

import filecmp
import json
import lzma
import os
import uuid
from pathlib import Path

import pytest

from megatron_train.tokenizer import build_tokenizer
from megatron_train.tokenizer.train import train_byte_level_bpe, train_wordpiece
from stages import train_tokenizer
from stages.shards import shard_file, shard_name
from stages.train_tokenizer import TrainTokenizerParams, iter_texts, load_trained_tokenizer
from storage.artifacts import ArtifactStore
from storage.documents import write_parquet_shard

KJV = Path(__file__).resolve().parents[1] / "stages" / "corpora" / "kjv.jsonl.xz"
HELD_OUT = "Blessed are the meek: for they shall inherit the earth. Ünïcode 🤖, tabs\t\tand  spaces\n\n"


@pytest.fixture(scope="module")
def chapters() -> list[str]:
    """The first 30 chapters of the corpus the project embeds (about 100 KB)."""
    with lzma.open(KJV, "rt", encoding="utf-8") as f:
        return [json.loads(next(f))["text"] for _ in range(30)]


def test_byte_level_bpe_files_load_in_ours_and_transformers(chapters, tmp_path):
    transformers = pytest.importorskip("transformers")
    files = train_byte_level_bpe(iter(chapters), str(tmp_path), vocab_size=800)  # a one-pass iterator
    assert {k: os.path.basename(v) for k, v in files.items()} == {
        "vocab_file": "vocab.json",
        "merge_file": "merges.txt",
        "tokenizer_json": "tokenizer.json",
        "tokenizer_config": "tokenizer_config.json",
    }
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=files["vocab_file"], merge_file=files["merge_file"])
    from_json = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=files["tokenizer_json"])
    from_folder = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    reference = transformers.GPT2Tokenizer(files["vocab_file"], files["merge_file"])
    ids = ours.tokenize(HELD_OUT)
    assert ids == reference.encode(HELD_OUT) == from_json.tokenize(HELD_OUT) == from_folder.tokenize(HELD_OUT)
    assert ours.detokenize(ids) == HELD_OUT
    verse = "Blessed are the meek: for they shall inherit the earth."
    assert len(ours.tokenize(verse)) < len(verse) // 2  # merges learnt from the corpus compress its language
    assert ours.vocab_size == from_json.vocab_size == 800
    assert ours.eod == from_json.eod == from_folder.eod == ours.vocab["<|endoftext|>"] == 0
    merges = Path(files["merge_file"]).read_text(encoding="utf-8").splitlines()
    assert merges[0].startswith("#version") and len(merges) - 1 == 800 - 256 - 1  # alphabet 256 + 1 special


def test_byte_level_bpe_is_deterministic_and_respects_min_frequency(chapters, tmp_path):
    first = train_byte_level_bpe(chapters, str(tmp_path / "a"), vocab_size=500)
    second = train_byte_level_bpe((text for text in chapters), str(tmp_path / "b"), vocab_size=500)
    for role in first:
        assert filecmp.cmp(first[role], second[role], shallow=False), role
    # A pair seen fewer than min_frequency times is never merged: with a huge threshold, no merges at all.
    rare = train_byte_level_bpe(chapters[:1], str(tmp_path / "c"), vocab_size=500, min_frequency=10**9)
    assert Path(rare["merge_file"]).read_text(encoding="utf-8").splitlines()[1:] == []
    with pytest.raises(ValueError, match="at least the end-of-document token"):
        train_byte_level_bpe(chapters, str(tmp_path / "d"), special_tokens=())


@pytest.mark.parametrize("lowercase", [True, False])
def test_wordpiece_vocab_loads_in_ours_and_transformers(chapters, tmp_path, lowercase):
    pytest.importorskip("transformers")
    from tests.helpers.wordpiece_corpus import slow_bert

    files = train_wordpiece(iter(chapters), str(tmp_path), vocab_size=1200, lowercase=lowercase)
    lines = Path(files["vocab_file"]).read_text(encoding="utf-8").splitlines()
    assert lines[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and len(lines) == 1200
    tokenizer_type = "BertWordPieceLowerCase" if lowercase else "BertWordPieceCase"
    ours = build_tokenizer(tokenizer_type, vocab_file=files["vocab_file"])
    reference = slow_bert(files["vocab_file"], lower_case=lowercase)
    for text in (HELD_OUT, *chapters[-2:]):
        assert ours.tokenize(text) == reference.convert_tokens_to_ids(reference.tokenize(text))
    assert (ours.pad, ours.cls, ours.sep, ours.mask) == (0, 2, 3, 4)
    assert ("God" in ours.vocab) == (not lowercase) and ("god" in ours.vocab) == lowercase
    with pytest.raises(ValueError, match=r"must include '\[UNK\]'"):
        train_wordpiece(chapters, str(tmp_path), special_tokens=("[PAD]",))


# --- the stage ---------------------------------------------------------------------------------------------


def make_documents(store: ArtifactStore, chapters: list[str], per_shard: int = 12, key: str = "docs"):
    """An artifact shaped like the corpus stages' output: shards/00000.parquet, ... with id and text."""
    writer = store.begin("download", key)
    for index in range(0, len(chapters), per_shard):
        name = shard_name(index // per_shard)
        rows = [{"id": f"c{i}", "text": t} for i, t in enumerate(chapters[index : index + per_shard], index)]
        local = os.path.join(writer.local_dir, shard_file(name))
        write_parquet_shard(rows, local)
        writer.commit_shard(name, {shard_file(name): local})
    return writer.commit({"counts": {"docs": len(chapters)}})


def test_stage_trains_from_shards_and_hits_the_cache(chapters, tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    documents = make_documents(store, chapters)
    params = TrainTokenizerParams(vocab_size=700)
    ref = train_tokenizer.run(params, [documents], store)
    assert not ref.cache_hit
    manifest = ref.manifest()
    assert manifest["counts"]["documents"] == 30
    assert manifest["counts"]["characters"] == sum(len(t) for t in chapters)
    assert manifest["counts"]["vocab_size"] == 700
    assert manifest["tokenizer"] == {
        "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": "vocab.json",
        "merge_file": "merges.txt",
        "tokenizer_json": "tokenizer.json",
        "tokenizer_config": "tokenizer_config.json",
    }
    assert set(manifest["files"]) == {"vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"}
    tokenizer = load_trained_tokenizer(ref)
    assert tokenizer.detokenize(tokenizer.tokenize(HELD_OUT)) == HELD_OUT and tokenizer.eod == 0

    again = train_tokenizer.run(
        TrainTokenizerParams(kind="bpe", vocab_size=700, special_tokens=None), [documents], store
    )
    assert again.cache_hit and again.url == ref.url  # defaults spelled out or not: same key

    # Same input in another store: the same bytes (training is deterministic).
    other = ArtifactStore(str(tmp_path / "other"))
    rebuilt = train_tokenizer.run(params, [make_documents(other, chapters)], other).manifest()
    assert {n: f["hash"] for n, f in rebuilt["files"].items()} == {
        n: f["hash"] for n, f in manifest["files"].items()
    }


def test_stage_wordpiece_with_max_documents(chapters, tmp_path):
    store = ArtifactStore(str(tmp_path))
    documents = make_documents(store, chapters)
    params = TrainTokenizerParams(kind="wordpiece", vocab_size=900, lowercase=False, max_documents=13)
    ref = train_tokenizer.run(params, [documents], store)
    manifest = ref.manifest()
    assert manifest["counts"]["documents"] == 13  # crosses a shard boundary (12 a shard), then stops
    assert manifest["counts"]["characters"] == sum(len(t) for t in chapters[:13])
    assert manifest["tokenizer"] == {"tokenizer_type": "BertWordPieceCase", "vocab_file": "vocab.txt"}
    tokenizer = load_trained_tokenizer(ref)
    assert manifest["counts"]["vocab_size"] == tokenizer.vocab_size == 902  # + Megatron's [BOS], [EOS]
    assert "God" in tokenizer.vocab
    assert train_tokenizer.run(params, [documents], store).cache_hit


def test_stage_errors_name_the_problem(chapters, tmp_path):
    store = ArtifactStore(str(tmp_path))
    documents = make_documents(store, chapters[:3])
    with pytest.raises(ValueError, match=r"shards/00000\.parquet: no column 'body' \(columns: id, text\)"):
        train_tokenizer.run(TrainTokenizerParams(text_key="body"), [documents], store)
    writer = store.begin("download", "with-null")
    local = os.path.join(writer.local_dir, shard_file("00000"))
    write_parquet_shard([{"id": "a", "text": "fine"}, {"id": "b", "text": None}], local)
    writer.commit_shard("00000", {shard_file("00000"): local})
    with pytest.raises(
        ValueError, match=r"with-null/shards/00000\.parquet:2: field 'text' is null, not a string"
    ):
        train_tokenizer.run(TrainTokenizerParams(), [writer.commit({})], store)
    with pytest.raises(ValueError, match="exactly one input"):
        train_tokenizer.run(TrainTokenizerParams(), [], store)
    with pytest.raises(ValueError, match="kind must be one of bpe, wordpiece"):
        TrainTokenizerParams(kind="unigram")
    with pytest.raises(ValueError, match="max_documents must be at least 1"):
        TrainTokenizerParams(max_documents=0)


def test_stage_on_an_object_store(chapters, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_FLOW_CACHE", str(tmp_path / "cache"))
    store = ArtifactStore(f"memory://train-tokenizer-{uuid.uuid4().hex}")
    ref = train_tokenizer.run(
        TrainTokenizerParams(vocab_size=600), [make_documents(store, chapters[:10])], store
    )
    assert ref.url.startswith("memory://") and ref.manifest()["counts"]["documents"] == 10
    tokenizer = load_trained_tokenizer(ref)  # files fetched into the local cache
    assert tokenizer.vocab_size == 600 and tokenizer.detokenize(tokenizer.tokenize(HELD_OUT)) == HELD_OUT


def test_documents_are_streamed(chapters, tmp_path):
    store = ArtifactStore(str(tmp_path))
    documents = make_documents(store, chapters, per_shard=5)
    counts = {"documents": 0, "characters": 0}
    texts = iter_texts(documents, "text", counts)
    assert next(texts) == chapters[0] and counts == {"documents": 1, "characters": len(chapters[0])}
    assert list(texts) == chapters[1:] and counts["documents"] == 30
    assert list(iter_texts(documents, "text", {"documents": 0, "characters": 0}, limit=7)) == chapters[:7]
