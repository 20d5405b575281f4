"""TikTokenizer (Megatron's JSON vocabulary run by tiktoken): id layout, the v1/v2 patterns, errors."""

from __future__ import annotations

import base64
import json

import pytest

from megatron_train.tokenizer import build_tokenizer, tokenizer_from_config
from megatron_train.training.config import TokenizerConfig

pytest.importorskip("tiktoken")

MERGES = [b"th", b"the", b"oW", b"He", b"ll"]  # each the join of two lower-ranked tokens


def write_vocab(path, tokens: list[bytes]) -> str:
    """Megatron's TikTokenizer file: [{"rank", "token_bytes" (base64), "token_str"}] in rank order."""
    records = [
        {"rank": rank, "token_bytes": base64.b64encode(token).decode(), "token_str": token.decode("latin-1")}
        for rank, token in enumerate(tokens)
    ]
    path.write_text(json.dumps(records))
    return str(path)


@pytest.fixture
def vocab_file(tmp_path) -> str:
    return write_vocab(tmp_path / "tiktoken.json", [bytes([b]) for b in range(256)] + MERGES)


def test_ids_follow_megatrons_layout(vocab_file) -> None:
    tokenizer = build_tokenizer("TikTokenizer", tokenizer_model=vocab_file, tiktoken_pattern="v2")
    assert tokenizer.vocab_size == 1000 + 256 + len(MERGES)
    assert (tokenizer.bos, tokenizer.eod, tokenizer.mask, tokenizer.pad, tokenizer.cls, tokenizer.sep) == (
        1, 2, 3, 4, 5, 6,
    )  # fmt: skip
    the, space = 1000 + 256 + MERGES.index(b"the"), 1000 + ord(" ")
    assert tokenizer.tokenize("the the") == [the, space, the]
    assert tokenizer.tokenize("a</s>") == [1000 + ord("a"), 2]  # special text is its special id
    assert tokenizer.detokenize(tokenizer.tokenize("the HelloWorld")) == "the HelloWorld"
    assert tokenizer.vocab["the"] == the and tokenizer.inv_vocab[3] == "<mask>"
    small = build_tokenizer(
        "TikTokenizer", tokenizer_model=vocab_file, tiktoken_pattern="v1", tiktoken_num_special_tokens=7,
        vocab_size=7 + 257,
    )  # fmt: skip
    assert small.vocab_size == 264 and small.tokenize("the") == [
        263,
        7 + ord("e"),
    ]  # only the merge "th" kept


def test_v2_splits_at_case_changes_and_v1_does_not(vocab_file) -> None:
    merged = 1000 + 256 + MERGES.index(b"oW")
    ids = {
        pattern: build_tokenizer(
            "TikTokenizer", tokenizer_model=vocab_file, tiktoken_pattern=pattern
        ).tokenize("HelloWorld")
        for pattern in ("v1", "v2")
    }
    assert merged in ids["v1"] and merged not in ids["v2"]  # v2 pre-splits "Hello" | "World"


def test_the_flags_reach_the_tokenizer_and_errors_name_them(vocab_file, tmp_path) -> None:
    config = TokenizerConfig(tokenizer_type="TikTokenizer", tokenizer_model=vocab_file, tiktoken_pattern="v1")
    assert tokenizer_from_config(config).vocab_size == 1000 + 261
    with pytest.raises(ValueError, match="needs --tiktoken-pattern v1 or v2"):
        build_tokenizer("TikTokenizer", tokenizer_model=vocab_file)
    with pytest.raises(ValueError, match="--vocab-size 2000 needs 1000 BPE tokens"):
        build_tokenizer("TikTokenizer", tokenizer_model=vocab_file, tiktoken_pattern="v2", vocab_size=2000)
    shuffled = write_vocab(tmp_path / "bad.json", [bytes([b]) for b in range(255, -1, -1)])
    with pytest.raises(ValueError, match="bad.json: record 0 has rank 0 and bytes"):
        build_tokenizer("TikTokenizer", tokenizer_model=shuffled, tiktoken_pattern="v2")
