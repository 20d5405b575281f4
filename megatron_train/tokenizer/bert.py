"""BertWordPieceLowerCase / BertWordPieceCase: BERT's WordPiece from vocab.txt, id-for-id with Megatron's.

Megatron's BERT tokenizer (Google's original FullTokenizer) differs from Hugging Face's in details that show
in ids and sizes, and we follow Megatron: words up to 200 characters are split into pieces (not 100);
"[BOS]" and "[EOS]" (then `--vocab-extra-ids` "<extra_id_i>" sentinels) are appended to the vocabulary when
it lacks them, so `vocab_size` is the file's size plus those; `eod` is the "[EOS]" id; and `detokenize`
joins the pieces with spaces and glues "##" continuations back on.

Known differences from Megatron, all on rare code points: the Rust normaliser keeps unassigned code points
(Python deletes them as control characters, so a word holding one becomes [UNK] here); its character classes
come from an older Unicode version than Python's (punctuation added since, e.g. U+2E43..U+2E5D, is not split
off); it treats CJK Extension E U+2B820..U+2B91F as ordinary letters; and as text is lower-cased before
control characters are deleted, a capital sigma beside one may become σ where Megatron writes ς.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import tokenizers
from tokenizers import models, normalizers, pre_tokenizers

from megatron_train.tokenizer.base import checked_ids, lookup_token, stored_id
from megatron_train.tokenizer.fast import FastTokenizer

UNK_TOKEN = "[UNK]"
MAX_INPUT_CHARS_PER_WORD = 200  # Google's (and Megatron's) limit; longer words become [UNK]
ADDED_TOKENS = ("[BOS]", "[EOS]")


def read_wordpiece_vocab(vocab_file: str) -> dict[str, int]:
    """A BERT vocab.txt: one token a line, the id is the line number (from 0), surrounding spaces stripped."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = {line.strip(): index for index, line in enumerate(f)}
    except UnicodeDecodeError as err:
        raise ValueError(f"--vocab-file {vocab_file}: not a UTF-8 vocab.txt ({err})") from err
    if vocab_file.endswith(".json") or next(iter(vocab), "").startswith("{"):
        raise ValueError(
            f"--vocab-file {vocab_file}: looks like JSON, not a BERT vocab.txt (one token a line); "
            "for a GPT-2 vocab.json use GPT2BPETokenizer with --merge-file"
        )
    return vocab


def wordpiece(vocab: dict[str, int], strip_accents: bool) -> tokenizers.Tokenizer:
    """BERT's pipeline after lower-casing: clean, split CJK characters, (strip accents), split on spaces and
    punctuation, then greedy longest-match WordPiece with "##" continuations."""
    tokenizer = tokenizers.Tokenizer(
        models.WordPiece(vocab, unk_token=UNK_TOKEN, max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD)
    )
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=False
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer


class BertWordPieceTokenizer(FastTokenizer):
    """Megatron's `--tokenizer-type BertWordPieceLowerCase` (lower_case=True) and `BertWordPieceCase`."""

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0):
        file_vocab = read_wordpiece_vocab(vocab_file)
        source = f"--vocab-file {vocab_file}"
        fix = "is this a BERT vocab.txt?"
        lookup_token(file_vocab, UNK_TOKEN, source, fix)
        super().__init__(wordpiece(file_vocab, strip_accents=lower_case))
        self._lower_case = lower_case
        self._cls, self._sep, self._pad, self._mask = (
            lookup_token(file_vocab, token, source, fix) for token in ("[CLS]", "[SEP]", "[PAD]", "[MASK]")
        )
        self._vocab = dict(file_vocab)
        self.additional_special_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in (*ADDED_TOKENS, *self.additional_special_tokens):
            self._vocab.setdefault(token, len(self._vocab))

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @cached_property
    def inv_vocab(self) -> dict[int, str]:
        return {token_id: token for token, token_id in self._vocab.items()}

    def _lower(self, text: str) -> str:
        # Python's lower() (as Google's tokenizer), not Rust's: they differ on Greek final sigma.
        return text.lower() if self._lower_case else text

    def tokenize(self, text: str) -> list[int]:
        return super().tokenize(self._lower(text))

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return super().tokenize_batch([self._lower(text) for text in texts])

    def detokenize(self, ids: Sequence[int]) -> str:
        tokens = [self.inv_vocab[i] for i in checked_ids(ids, self.vocab_size)]
        return " ".join(tokens).replace(" ##", "").strip()

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return [self._vocab[token] for token in self.additional_special_tokens]

    cls = stored_id("_cls")
    sep = stored_id("_sep")
    pad = stored_id("_pad")
    mask = stored_id("_mask")

    @property
    def bos(self) -> int:
        return self._vocab["[BOS]"]

    @property
    def eos(self) -> int:
        return self._vocab["[EOS]"]

    @property
    def eod(self) -> int:
        return self.eos
