"""GPT2BPETokenizer: GPT-2's byte-level BPE from vocab.json + merges.txt, id-for-id with Megatron's.

Like Megatron's, it registers no special tokens: the text "<|endoftext|>" is encoded as ordinary characters,
and documents are separated by appending `eod` (the id of <|endoftext|>, 50256 in GPT-2's vocabulary).

Encoding splits the text with GPT-2's regex (the `regex` module, as OpenAI's and Megatron's code) and looks
each piece up in a cache of piece -> ids, running the Rust BPE only on pieces not seen before. Natural text
repeats its words, so this is about 3x the single-thread speed of the all-Rust pipeline, whose regex engine
is the bottleneck; the tokenize stage runs one single-threaded tokenizer per process.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import regex
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from megatron_train.tokenizer.base import lookup_token, stored_id
from megatron_train.tokenizer.fast import FastTokenizer

EOD_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenization: contractions, letter runs, digit runs, other symbols, each with one leading
# space; whitespace runs leave their last space to the next piece.
PRETOKENIZE = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
MAX_CACHED_PIECES = 1 << 18  # about 50 MB; the cache starts over when full


def read_bpe_vocab(vocab_file: str) -> dict[str, int]:
    """A GPT-2 vocab.json: one JSON object mapping token strings to ids."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json ({err})") from err
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ValueError(
            f"--vocab-file {vocab_file}: not a GPT-2 vocab.json (expected a JSON object token -> id); "
            "for a vocab.txt (one token a line) use BertWordPieceLowerCase or BertWordPieceCase"
        )
    return vocab


def read_bpe_merges(merge_file: str) -> list[tuple[str, str]]:
    """A GPT-2 merges.txt: an optional '#version' line, then one 'left right' pair a line, by priority."""
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.startswith("#version") or not line.strip():
                continue
            pair = line.rstrip("\r\n").split(" ")
            if len(pair) != 2:
                raise ValueError(
                    f"--merge-file {merge_file}:{line_no}: expected two tokens separated by one space, "
                    f"got {line.rstrip()!r}; is this a GPT-2 merges.txt?"
                )
            merges.append((pair[0], pair[1]))
    return merges


def byte_level_bpe(model: models.BPE) -> tokenizers.Tokenizer:
    """GPT-2's pipeline around a BPE model: its regex pre-tokenizer over bytes mapped to printable
    characters (no prefix space), and the inverse mapping to decode."""
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class GPT2BPETokenizer(FastTokenizer):
    """Megatron's `--tokenizer-type GPT2BPETokenizer`."""

    def __init__(self, vocab_file: str, merge_file: str):
        vocab, merges = read_bpe_vocab(vocab_file), read_bpe_merges(merge_file)
        try:
            model = models.BPE(vocab=vocab, merges=merges)
        except Exception as err:  # the Rust binding raises a bare Exception naming the bad merge
            raise ValueError(
                f"--merge-file {merge_file}: its merges do not match --vocab-file {vocab_file} ({err})"
            ) from err
        super().__init__(byte_level_bpe(model))
        # The same model without the regex split: encodes one pre-tokenized piece.
        self._piece_tokenizer = tokenizers.Tokenizer(model)
        self._piece_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=False
        )
        self._piece_ids: dict[str, list[int]] = {}
        self._eod = lookup_token(
            vocab,
            EOD_TOKEN,
            f"--vocab-file {vocab_file}",
            "GPT2BPETokenizer needs it as the end-of-document token",
        )

    eod = stored_id("_eod")
    eos = stored_id("_eod")

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._piece_ids
        for piece in PRETOKENIZE.findall(text):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                if len(cache) >= MAX_CACHED_PIECES:
                    cache.clear()
                piece_ids = cache[piece] = self._piece_tokenizer.encode(piece).ids
            ids += piece_ids
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(text) for text in texts]
