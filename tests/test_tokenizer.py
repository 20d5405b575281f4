"""megatron_train/tokenizer: ids exactly as Megatron's tokenizers give them, special ids, padding, errors."""

import argparse
import json
import lzma
import pickle
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import regex

from megatron_train.tokenizer import (
    TOKENIZER_TYPES,
    MegatronTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)
from megatron_train.tokenizer import gpt2 as gpt2_module
from megatron_train.tokenizer.train import train_byte_level_bpe
from tests.helpers.wordpiece_corpus import slow_bert

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ROOT.parent / "shared" / "vocab"
GPT2_VOCAB, GPT2_MERGES = VOCAB / "gpt2-vocab.json", VOCAB / "gpt2-merges.txt"
BERT_VOCAB = VOCAB / "bert-base-uncased-vocab.txt"
needs_gpt2 = pytest.mark.skipif(not GPT2_MERGES.exists(), reason="needs ../shared/vocab/gpt2-*")
needs_bert = pytest.mark.skipif(
    not BERT_VOCAB.exists(), reason="needs ../shared/vocab/bert-base-uncased-vocab.txt"
)

TEXTS = [
    "Hello world! How's it going?",
    "  leading spaces\n\n\nnewlines\t\ttabs   trailing   ",
    "I'm sure they've said we'll, she'd, it's, CAN'T, don't",
    "émoji 🤖🎉👩‍👩‍👧 中文字符 日本語 한국어 Ünïcödé naïve café",
    "numbers 1234567 3.14159 1,000,000 0x1F",
    "a\u00a0non-breaking\u2028line sep\r\nwindows\x0bvt\x00nul \ufeffbom",
    "",
    " ",
    "\n\n",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "Ωmega ΣΑΣ straße İstanbul ﬁ ǅ",
    "x" * 300,
]


def kjv_chapters(count: int) -> list[str]:
    """The first chapters of the corpus the project embeds."""
    with lzma.open(ROOT / "stages" / "corpora" / "kjv.jsonl.xz", "rt", encoding="utf-8") as f:
        return [json.loads(next(f))["text"] for _ in range(count)]


# --- GPT-2 -------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


class ReferenceGPT2:
    """OpenAI's original GPT-2 encoder (encoder.py), the algorithm Megatron's gpt2_tokenization copies."""

    PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, vocab_file, merge_file):
        self.encoder = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
        lines = Path(merge_file).read_text(encoding="utf-8").splitlines()[1:]
        self.ranks = {tuple(line.split()): rank for rank, line in enumerate(line for line in lines if line)}
        self.byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}

    def bpe(self, word: list[str]) -> list[str]:
        while len(word) > 1:
            best = min(zip(word, word[1:], strict=False), key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def encode(self, text: str) -> list[int]:
        return [
            self.encoder[piece]
            for token in self.PATTERN.findall(text)
            for piece in self.bpe([self.byte_encoder[b] for b in token.encode("utf-8")])
        ]

    def decode(self, ids: list[int]) -> str:
        decoder = {i: t for t, i in self.encoder.items()}
        return bytes(self.byte_decoder[c] for i in ids for c in decoder[i]).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("GPT2BPETokenizer", vocab_file=str(GPT2_VOCAB), merge_file=str(GPT2_MERGES))


@needs_gpt2
def test_gpt2_ids_equal_reference_bpe_and_transformers(gpt2):
    transformers = pytest.importorskip("transformers")
    reference = ReferenceGPT2(GPT2_VOCAB, GPT2_MERGES)
    hf = transformers.GPT2Tokenizer(str(GPT2_VOCAB), str(GPT2_MERGES))
    texts = TEXTS + kjv_chapters(2)
    for text in texts:
        ids = gpt2.tokenize(text)
        assert ids == reference.encode(text), text
        assert ids == hf.encode(text), text
    assert gpt2.tokenize_batch(texts) == [gpt2.tokenize(text) for text in texts]
    assert gpt2.tokenize("Hello world!") == [15496, 995, 0]


@needs_gpt2
def test_gpt2_special_ids_and_vocab(gpt2):
    assert gpt2.eod == gpt2.eos == 50256
    assert gpt2.vocab_size == len(gpt2.vocab) == 50257
    assert gpt2.vocab["<|endoftext|>"] == 50256 and gpt2.inv_vocab[50256] == "<|endoftext|>"
    assert gpt2.inv_vocab[15496] == "Hello"
    for absent in ("cls", "sep", "mask", "pad", "bos"):
        with pytest.raises(NotImplementedError, match="GPT2BPETokenizer has no"):
            getattr(gpt2, absent)
    # As Megatron's: the text "<|endoftext|>" is ordinary characters; documents end with an appended eod.
    assert 50256 not in gpt2.tokenize("a<|endoftext|>b")


@needs_gpt2
def test_gpt2_detokenize_round_trips_and_replaces_broken_bytes(gpt2):
    reference = ReferenceGPT2(GPT2_VOCAB, GPT2_MERGES)
    for text in TEXTS:
        assert gpt2.detokenize(gpt2.tokenize(text)) == text
    robot = gpt2.tokenize("🤖 ok")
    for end in range(len(robot)):  # cut inside the emoji's bytes: U+FFFD as Python's errors="replace"
        assert gpt2.detokenize(robot[:end]) == reference.decode(robot[:end])
    assert gpt2.detokenize([50256]) == "<|endoftext|>"
    assert gpt2.detokenize(np.array(robot)) == "🤖 ok"
    with pytest.raises(ValueError, match=r"ids \[50257, -1\] are outside the vocabulary \(size 50257\)"):
        gpt2.detokenize([15496, 50257, -1])  # e.g. a padded embedding row


def test_gpt2_piece_cache_gives_the_all_rust_pipeline_ids(trained_bpe, monkeypatch):
    monkeypatch.setattr(gpt2_module, "MAX_CACHED_PIECES", 5)  # the cache starts over many times
    monkeypatch.setattr(gpt2_module, "tiktoken_bpe", lambda vocab, merges: None)  # the `tokenizers` engine
    tok = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=trained_bpe["vocab_file"], merge_file=trained_bpe["merge_file"]
    )
    assert tok.engine == "tokenizers"
    texts = TEXTS + kjv_chapters(2) + fuzz_texts(300, seed=1)
    for text in texts + texts[::-1]:
        assert tok.tokenize(text) == tok.backend.encode(text).ids, repr(text)


@needs_gpt2
def test_gpt2_files_run_on_tiktoken_with_the_reference_ids(gpt2):
    assert gpt2.engine == "tiktoken"
    reference = ReferenceGPT2(GPT2_VOCAB, GPT2_MERGES)
    for text in TEXTS + kjv_chapters(3) + fuzz_texts(300, seed=2):
        assert gpt2.tokenize(text) == reference.encode(text), repr(text)


def test_trained_vocabulary_runs_on_tiktoken_with_the_all_rust_pipeline_ids(trained_bpe):
    tok = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=trained_bpe["vocab_file"], merge_file=trained_bpe["merge_file"]
    )
    assert tok.engine == "tiktoken"  # special tokens first, then the bytes, then the merges in order
    texts = TEXTS + kjv_chapters(2) + fuzz_texts(300, seed=3)
    assert tok.tokenize_batch(texts) == [tok.backend.encode(text).ids for text in texts]


def test_tiktoken_is_not_used_where_its_merge_rule_or_sample_ids_could_differ(
    trained_bpe, tmp_path, monkeypatch
):
    vocab = json.loads(Path(trained_bpe["vocab_file"]).read_text())
    merges = gpt2_module.read_bpe_merges(trained_bpe["merge_file"])
    first, last = "".join(merges[0]), "".join(merges[-1])
    vocab[first], vocab[last] = vocab[last], vocab[first]  # ids no longer grow in merge order
    swapped = tmp_path / "vocab.json"
    swapped.write_text(json.dumps(vocab))
    assert gpt2_module.tiktoken_bpe(vocab, merges) is None
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(swapped), merge_file=trained_bpe["merge_file"])
    assert tok.engine == "tokenizers"
    texts = TEXTS + kjv_chapters(1)
    assert tok.tokenize_batch(texts) == [tok.backend.encode(text).ids for text in texts]

    # tiktoken with another pre-tokenization than the reference's: the sample check catches it.
    monkeypatch.setattr(gpt2_module, "PRETOKENIZE", regex.compile(r"\S+|\s+"))
    tok = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=trained_bpe["vocab_file"], merge_file=trained_bpe["merge_file"]
    )
    assert tok.engine == "tokenizers"


# --- BERT --------------------------------------------------------------------------------------------------


def fuzz_texts(count: int, seed: int = 0) -> list[str]:
    """Random strings over letters, accents, CJK, emoji, punctuation, spaces and control characters."""
    pool = (
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
        "éèêëÉÀçñÑüÜößØåÆœ" + "\u0301\u0308" + "ΑΣΩσςαβ" + "中文字日本語" + "한국" + "🤖🎉"
        ".,;:!?'\"()-–—…/\\@#$%^&*_+=<>{}|~`" + "    \t\n\r\u00a0\u2028\u3000\x00\x0b\x1f\u200b\ufeff\ufffd"
    )
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randint(0, 40))) for _ in range(count)]


@needs_bert
@pytest.mark.parametrize(
    "tokenizer_type, lower_case", [("BertWordPieceLowerCase", True), ("BertWordPieceCase", False)]
)
def test_bert_ids_equal_transformers_slow_tokenizer(tokenizer_type, lower_case):
    ours = build_tokenizer(tokenizer_type, vocab_file=str(BERT_VOCAB))
    slow = slow_bert(BERT_VOCAB, lower_case)
    texts = TEXTS[:-1] + kjv_chapters(1) + fuzz_texts(300)
    for text in texts:
        assert ours.tokenize(text) == slow.convert_tokens_to_ids(slow.tokenize(text)), repr(text)
    assert ours.tokenize_batch(texts) == [ours.tokenize(text) for text in texts]


@needs_bert
def test_bert_case_variants_and_megatron_semantics():
    lower = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(BERT_VOCAB))
    cased = build_tokenizer("BertWordPieceCase", vocab_file=str(BERT_VOCAB))
    assert lower.tokenize("Hello Café") == [7592, 7668]  # hello, cafe: lower-cased, accent stripped
    unk = lower.vocab["[UNK]"]
    assert cased.tokenize("Hello Café") == [unk, unk]  # an uncased vocabulary has neither "Hello" nor "Café"
    assert cased.tokenize("hello cafe") == [7592, 7668]
    # Megatron's (Google's) WordPiece splits words up to 200 characters; longer ones are [UNK].
    assert unk not in lower.tokenize("ab" * 75)
    assert lower.tokenize("ab" * 101) == [unk]
    # Megatron's detokenize: pieces joined by spaces, "##" continuations glued back.
    assert lower.detokenize(lower.tokenize("Hello, unaffable World!")) == "hello , unaffable world !"


@needs_bert
def test_bert_special_ids_follow_megatron():
    bert = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(BERT_VOCAB))
    assert (bert.cls, bert.sep, bert.mask, bert.pad) == (101, 102, 103, 0)
    # Megatron appends [BOS] and [EOS] to the vocabulary; eod is [EOS].
    assert (bert.bos, bert.eos, bert.eod) == (30522, 30523, 30523)
    assert bert.vocab_size == 30524 and bert.inv_vocab[30523] == "[EOS]"
    extra = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(BERT_VOCAB), vocab_extra_ids=3)
    assert extra.vocab_size == 30527
    assert extra.additional_special_tokens_ids == [30524, 30525, 30526]
    assert extra.inv_vocab[30526] == "<extra_id_2>"
    assert bert.detokenize([101, 7592, 102]) == "[CLS] hello [SEP]"


def test_bert_on_a_small_vocabulary(tmp_path):
    vocab = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        "un",
        "##aff",
        "##able",
        "the",
        ",",
        "σας",
        "naive",
    ]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    bert = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(path))
    assert bert.tokenize("Unaffable, THE  naïve ΣΑΣ!") == [5, 6, 7, 9, 8, 11, 10, 1]
    assert bert.vocab_size == len(vocab) + 2 and bert.eod == len(vocab) + 1
    assert bert.detokenize([5, 6, 7, 9]) == "unaffable ,"
    assert bert.cls not in bert.tokenize("[CLS] the")  # as Megatron's: special names in text are just text
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        bert.detokenize([999])


# --- NullTokenizer, padding ------------------------------------------------------------------------------


def test_null_tokenizer_follows_megatron():
    null = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert null.tokenize("5 17\n 999\t0") == [5, 17, 999, 0]
    assert null.tokenize_batch(["1 2", ""]) == [[1, 2], []]
    assert null.detokenize([5, 17, 1000]) == "5 17 1000"
    assert null.eod == null.eos == 1000 and null.vocab_size == 1001  # eod = --vocab-size = vocab_size - 1
    assert (null.cls, null.sep, null.mask) == (-1, -1, -1)
    with pytest.raises(NotImplementedError):
        null.vocab  # noqa: B018
    with pytest.raises(ValueError, match="whitespace-separated integers"):
        null.tokenize("1 two 3")


@pytest.mark.parametrize(
    "orig, divisible_by, tp, padded",
    [
        (50257, 128, 1, 50304),
        (50257, 128, 8, 51200),
        (30524, 128, 2, 30720),
        (32000, 128, 1, 32000),
        (32001, 64, 1, 32064),
        (1001, 1, 1, 1001),
        (1, 128, 4, 512),
    ],
)
def test_vocab_size_with_padding(orig, divisible_by, tp, padded):
    assert vocab_size_with_padding(orig, divisible_by, tp) == padded


def test_vocab_size_with_padding_rejects_non_positive_multiple():
    with pytest.raises(ValueError, match="must be positive"):
        vocab_size_with_padding(100, 0, 1)


# --- SentencePiece ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    sentencepiece = pytest.importorskip("sentencepiece")
    prefix = tmp_path_factory.mktemp("spm") / "tiny"
    lines = [line for chapter in kjv_chapters(4) for line in chapter.splitlines()]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=300, model_type="unigram",
        character_coverage=1.0, minloglevel=2, num_threads=1,
    )  # fmt: skip
    return str(prefix) + ".model"


def test_sentencepiece_tokenizer_adds_megatron_specials(spm_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model, vocab_extra_ids=2)
    n = sp.get_piece_size()
    # <CLS> <SEP> <EOD> <MASK> appended, <PAD> too (the model has none), then the sentinels; <s> </s> exist.
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad) == (n, n + 1, n + 2, n + 3, n + 4)
    assert (tok.bos, tok.eos) == (sp.bos_id(), sp.eos_id())
    assert tok.additional_special_tokens_ids == [n + 5, n + 6] and tok.vocab_size == n + 7
    text = "And God said, Let there be light"
    assert tok.tokenize(text) == sp.encode(text)
    assert tok.tokenize(f"{text}<EOD>light<MASK>") == [
        *sp.encode(text),
        tok.eod,
        *sp.encode("light"),
        tok.mask,
    ]
    assert tok.tokenize("light</s>")[-1] == tok.eos  # the model's own control pieces are matched too
    texts = [text, "light<SEP></s>", "", "<CLS>"]
    assert tok.tokenize_batch(texts) == [tok.tokenize(t) for t in texts]
    assert tok.detokenize(sp.encode(text)) == text
    assert tok.detokenize([*sp.encode("Let"), tok.eod, *sp.encode("light")]) == "Let <EOD> light"


def test_llama2_and_gpt_sentencepiece_tokenizers(spm_model, monkeypatch):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=spm_model)
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=spm_model)
    text = "In the beginning God created the heaven"
    assert llama.tokenize(text) == [sp.bos_id(), *sp.encode(text)]
    assert gpt.tokenize(text) == sp.encode(text)
    assert llama.tokenize_batch([text, ""]) == [llama.tokenize(text), [sp.bos_id()]]
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # one thread per process: the same ids
    assert gpt.tokenize_batch([text, text]) == [sp.encode(text)] * 2
    for tok in (llama, gpt):
        assert tok.vocab_size == sp.get_piece_size() and tok.eod == tok.eos == sp.eos_id()
        assert (tok.cls, tok.sep, tok.mask) == (-1, -1, -1)
        assert tok.detokenize(tok.tokenize(text)) == text
        assert tok.inv_vocab[tok.vocab["▁the"]] == "▁the"


def test_sentencepiece_missing_package_says_what_to_install(spm_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(ImportError, match=r"pip install megatron-flow\[sentencepiece\]"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=spm_model)


def test_sentencepiece_bad_model_file_is_named(tmp_path):
    pytest.importorskip("sentencepiece")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"bad\.model: not a SentencePiece \.model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(bad))


# --- HuggingFaceTokenizer --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_bpe(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    return train_byte_level_bpe(
        kjv_chapters(10), str(out), vocab_size=600, special_tokens=["<|endoftext|>", "<pad>"]
    )


def test_huggingface_tokenizer_from_file_and_folder(trained_bpe, tmp_path):
    import shutil

    pytest.importorskip("transformers")
    text = "And God saw the light, that it was good. Ünïcode 🤖\n\n  end"
    gpt2 = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=trained_bpe["vocab_file"], merge_file=trained_bpe["merge_file"]
    )
    folder = str(Path(trained_bpe["tokenizer_json"]).parent)
    alone = tmp_path / "tokenizer.json"  # no tokenizer_config.json beside it: eod found by its known name
    shutil.copy(trained_bpe["tokenizer_json"], alone)
    for source in (trained_bpe["tokenizer_json"], folder, str(alone)):
        hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=source)
        assert hf.tokenize(text) == gpt2.tokenize(text), source
        assert hf.tokenize_batch([text, ""]) == [gpt2.tokenize(text), []]
        assert hf.detokenize(hf.tokenize(text)) == text
        assert hf.eod == hf.eos == hf.vocab["<|endoftext|>"] == 0
        assert hf.vocab_size == 600 and hf.inv_vocab[1] == "<pad>"
        assert hf.bos is None and hf.pad is None  # absent, as Megatron's wrapper reports them


def test_huggingface_tokenizer_file_applies_its_post_processor(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(
        models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2, "a": 3, "b": 4}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.enable_truncation(max_length=2)  # saved settings that must not cut documents
    tokenizer.enable_padding(length=8)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
    assert hf.tokenize("a b c") == [0, 3, 4, 2]  # BOS added, as transformers' tokenizer(text) does
    assert (hf.bos, hf.eos, hf.eod, hf.pad) == (0, 1, 1, None)


# --- Errors ----------------------------------------------------------------------------------------------


def test_unknown_tokenizer_type_lists_the_valid_ones():
    with pytest.raises(
        ValueError, match="unknown --tokenizer-type 'GPT3Tokenizer'.*GPT2BPETokenizer.*NullTokenizer"
    ):
        build_tokenizer("GPT3Tokenizer")
    assert {"GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "HuggingFaceTokenizer"} <= set(
        TOKENIZER_TYPES
    )
    assert {"SentencePieceTokenizer", "Llama2Tokenizer", "NullTokenizer"} <= set(TOKENIZER_TYPES)


def test_missing_arguments_and_files_name_the_flag_and_path(tmp_path):
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=__file__)
    with pytest.raises(FileNotFoundError, match=r"--vocab-file .*nope\.txt: no such file"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(tmp_path / "nope.txt"))
    with pytest.raises(FileNotFoundError, match=r"--tokenizer-model .*absent: no such file or folder"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="--vocab-extra-ids is only supported by"):
        build_tokenizer("NullTokenizer", vocab_size=10, vocab_extra_ids=2)


def test_wrong_file_formats_are_named(tmp_path, trained_bpe):
    vocab_txt = tmp_path / "vocab.txt"
    vocab_txt.write_text("[PAD]\n[UNK]\nhello\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab\.txt: not a GPT-2 vocab\.json"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab_txt), merge_file=trained_bpe["merge_file"])
    with pytest.raises(ValueError, match=r"vocab\.json: looks like JSON, not a BERT vocab\.txt"):
        build_tokenizer("BertWordPieceLowerCase", vocab_file=trained_bpe["vocab_file"])
    with pytest.raises(ValueError, match=r"vocab\.txt: the vocabulary has no '\[CLS\]' token"):
        build_tokenizer("BertWordPieceLowerCase", vocab_file=str(vocab_txt))
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nĠ t\nthree tokens here\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"merges\.txt:3: expected two tokens"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=trained_bpe["vocab_file"], merge_file=str(bad_merges))
    bad_merges.write_text("#version: 0.2\nzz qq\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"merges\.txt: its merges do not match --vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=trained_bpe["vocab_file"], merge_file=str(bad_merges))
    no_eod = tmp_path / "no_eod.json"
    vocab = json.loads(Path(trained_bpe["vocab_file"]).read_text(encoding="utf-8"))
    no_eod.write_text(json.dumps({t: i for t, i in vocab.items() if t != "<|endoftext|>"}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"no_eod\.json: the vocabulary has no '<\|endoftext\|>' token"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(no_eod), merge_file=trained_bpe["merge_file"])
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"model": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a Hugging Face tokenizer\.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(broken))


def test_every_type_is_a_megatron_tokenizer(trained_bpe, spm_model):
    files = {
        "GPT2BPETokenizer": {
            "vocab_file": trained_bpe["vocab_file"],
            "merge_file": trained_bpe["merge_file"],
        },
        "HuggingFaceTokenizer": {"tokenizer_model": trained_bpe["tokenizer_json"]},
        "NullTokenizer": {"vocab_size": 10},
        "SentencePieceTokenizer": {"tokenizer_model": spm_model},
        "GPTSentencePieceTokenizer": {"tokenizer_model": spm_model},
        "Llama2Tokenizer": {"tokenizer_model": spm_model},
    }
    for tokenizer_type, kwargs in files.items():
        tok = build_tokenizer(tokenizer_type, **kwargs)
        assert isinstance(tok, MegatronTokenizer)
        text = "1 2 3" if tokenizer_type == "NullTokenizer" else "Let there be light"
        assert tok.detokenize(tok.tokenize(text)) == text
        # Tokenizers travel to worker processes: a pickled copy gives the same ids.
        assert pickle.loads(pickle.dumps(tok)).tokenize(text) == tok.tokenize(text)


def test_huggingface_folder_errors(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"--tokenizer-model .*: not a loadable tokenizer folder"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="needs the transformers package: pip install transformers"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


def _option_strings(parser: argparse.ArgumentParser, group_title: str) -> set[str]:
    (group,) = [g for g in parser._action_groups if g.title == group_title]
    return {option for action in group._group_actions for option in action.option_strings}


def test_every_entry_point_parses_the_one_tokenizer_flag_definition():
    from megatron_train.arguments import build_parser
    from megatron_train.tasks.main import build_parser as tasks_parser
    from megatron_train.tokenizer.flags import add_tokenizer_args
    from megatron_train.tools.run_text_generation_server import build_parser as server_parser

    alone = argparse.ArgumentParser()
    add_tokenizer_args(alone)
    flags = _option_strings(alone, "tokenizer")
    assert {"--tokenizer-type", "--vocab-file", "--merge-file", "--tokenizer-model", "--vocab-size"} <= flags
    for parser in (build_parser(), server_parser(), tasks_parser()):
        assert _option_strings(parser, "tokenizer") == flags


def test_tokenizer_from_args_builds_what_the_flags_name(trained_bpe):
    from megatron_train.tokenizer.flags import add_tokenizer_args, tokenizer_from_args

    parser = argparse.ArgumentParser()
    add_tokenizer_args(parser)
    files = ["--vocab-file", trained_bpe["vocab_file"], "--merge-file", trained_bpe["merge_file"]]
    built = tokenizer_from_args(parser.parse_args(["--tokenizer-type", "GPT2BPETokenizer", *files]))
    expected = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=trained_bpe["vocab_file"], merge_file=trained_bpe["merge_file"]
    )
    assert built.tokenize("And God saw") == expected.tokenize("And God saw") and built.vocab_size == 600
    assert tokenizer_from_args(parser.parse_args(["--vocab-size", "7"])).vocab_size == 8  # NullTokenizer
    with pytest.raises(ValueError, match="no tokenizer: set --tokenizer-type"):
        tokenizer_from_args(parser.parse_args([]))
