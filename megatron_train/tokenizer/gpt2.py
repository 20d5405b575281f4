"""GPT2BPETokenizer: GPT-2's byte-level BPE from vocab.json + merges.txt, id-for-id with Megatron's.

Like Megatron's, it registers no special tokens: the text "<|endoftext|>" is encoded as ordinary characters,
and documents are separated by appending `eod` (the id of <|endoftext|>, 50256 in GPT-2's vocabulary).

Encoding runs on OpenAI's `tiktoken` where it gives the same ids (`tiktoken_bpe`): its BPE over the same
vocabulary, GPT-2's regex and the BPE both in Rust with no Python per piece, about 3x the single-thread speed of
the all-Rust `tokenizers` pipeline. tiktoken merges the adjacent pair whose concatenation has the lowest id,
`tokenizers` the pair listed first in merges.txt. Those are the same choice when every merged token is the
result of one merge and the results' ids grow in merge order (GPT-2's files and every vocabulary
`train_tokenizer` writes: checked on load), except where a token could also form from two other adjacent
parts than its merge's, which BPE training makes rare but does not exclude; so the ids are also compared on a
sample on load (tokens of the vocabulary, alone and run together, and `VERIFY_TEXTS`), and any difference, or
no tiktoken installed, keeps `tokenizers`. That path
splits the text with GPT-2's regex (the `regex` module, as OpenAI's and Megatron's code) and looks each piece
up in a cache of piece -> ids, running the Rust BPE only on pieces not seen before. The tokenize stage runs
one single-threaded tokenizer per process.
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
# Texts the tiktoken engine must encode exactly as `tokenizers` before it is used: contractions, whitespace
# runs, digits, accents, CJK, emoji, control characters.
VERIFY_TEXTS = (
    "Hello world! It's 2024; they'll say \"we've\" won't... 3.14159 x1000",
    "  leading spaces,\ttabs\t\tand\n\nnewlines \r\n trailing   ",
    "Ünïcödé façade naïve Ærø — «quotes» 中文字日本語 한국어 🤖🎉 \u00a0\u2028\u3000\x00\x0b\ufeff",
    "<|endoftext|> is ordinary text; so is 'S 'LL 'Re and O'Neill's",
)
VERIFY_TOKENS = 4096  # vocabulary tokens in the check's sample


def byte_alphabet() -> dict[int, str]:
    """GPT-2's `bytes_to_unicode`: each byte's printable stand-in in vocab.json and merges.txt."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


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


def tiktoken_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """A `tiktoken.Encoding` with the ids of these files, or None where tiktoken's merge rule could differ
    (see the module docstring) or tiktoken is not installed."""
    try:
        import tiktoken
    except ImportError:
        return None
    byte_of = {char: b for b, char in byte_alphabet().items()}
    results = [left + right for left, right in merges]
    ids = [vocab.get(token) for token in results]
    if (
        not all(char in vocab for char in byte_of)
        or None in ids
        or len(set(results)) != len(results)
        or any(a >= b for a, b in zip(ids, ids[1:], strict=False))
    ):
        return None
    ranks = {bytes([b]): vocab[char] for char, b in byte_of.items()}
    for token in results:
        if any(char not in byte_of for char in token):
            return None
        ranks[bytes(byte_of[char] for char in token)] = vocab[token]
    return tiktoken.Encoding(
        name="megatron-gpt2-bpe", pat_str=PRETOKENIZE.pattern, mergeable_ranks=ranks, special_tokens={}
    )


def verification_sample(merges: list[tuple[str, str]]) -> list[str]:
    """`VERIFY_TEXTS` and about `VERIFY_TOKENS` merged tokens as text, one by one and run together."""
    text_of = {char: b for b, char in byte_alphabet().items()}
    step = max(1, len(merges) // VERIFY_TOKENS)
    tokens = [
        bytes(text_of[c] for c in left + right).decode("utf-8", "replace") for left, right in merges[::step]
    ]
    return [*VERIFY_TEXTS, " ".join(tokens), "".join(tokens), *tokens[:256]]


class GPT2BPETokenizer(FastTokenizer):
    """Megatron's `--tokenizer-type GPT2BPETokenizer`; `engine` says which library encodes ("tiktoken" or
    "tokenizers")."""

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
        self._tiktoken = tiktoken_bpe(vocab, merges)
        if self._tiktoken is not None:
            sample = verification_sample(merges)
            if [self._tiktoken.encode_ordinary(t) for t in sample] != [
                self.backend.encode(t).ids for t in sample
            ]:
                self._tiktoken = None
        self.engine = "tokenizers" if self._tiktoken is None else "tiktoken"

    eod = stored_id("_eod")
    eos = stored_id("_eod")

    def tokenize(self, text: str) -> list[int]:
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)
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
