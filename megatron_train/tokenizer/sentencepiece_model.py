"""SentencePieceTokenizer, GPTSentencePieceTokenizer and Llama2Tokenizer over a SentencePiece `.model` file.

`sentencepiece` is an optional dependency (`pip install megatron-flow[sentencepiece]`), imported on first use.
Semantics follow Megatron's classes of the same names:
- SentencePieceTokenizer appends <CLS>, <SEP>, <EOD>, <MASK> (and <PAD>/<BOS>/<EOS> where the model has
  none, then `--vocab-extra-ids` sentinels) to the vocabulary, and encodes occurrences of those strings in
  the text as their ids.
- GPTSentencePieceTokenizer and Llama2Tokenizer use the model as is; `eod` is the model's EOS id and
  cls/sep/mask are -1; Llama2Tokenizer puts BOS in front of every text.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from megatron_train.tokenizer.base import NO_SUCH_TOKEN, MegatronTokenizer, stored_id


def load_sentencepiece(model_file: str, tokenizer_type: str) -> Any:
    """A `sentencepiece.SentencePieceProcessor`, with errors that say what to install or which file is bad."""
    try:
        import sentencepiece
    except ImportError as err:
        raise ImportError(
            f"{tokenizer_type} needs the sentencepiece package: pip install megatron-flow[sentencepiece]"
        ) from err
    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as err:
        raise ValueError(f"--tokenizer-model {model_file}: not a SentencePiece .model file ({err})") from err


def _batch_threads() -> int:
    """All cores (-1), or 1 where the caller runs one tokenizer per process and set
    TOKENIZERS_PARALLELISM=false (the switch Hugging Face tokenizers read) to avoid oversubscription."""
    return 1 if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("false", "0", "off", "no") else -1


class SentencePieceModelTokenizer(MegatronTokenizer):
    """The model's own pieces and ids; what Megatron's SentencePiece-based tokenizers have in common."""

    def __init__(self, model_file: str, tokenizer_type: str):
        self._sp = load_sentencepiece(model_file, tokenizer_type)
        self._vocab = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}
        self._inv_vocab = {i: piece for piece, i in self._vocab.items()}

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), num_threads=_batch_threads())

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    cls = sep = mask = NO_SUCH_TOKEN

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()


class GPTSentencePieceTokenizer(SentencePieceModelTokenizer):
    """Megatron's `--tokenizer-type GPTSentencePieceTokenizer`."""

    def __init__(self, model_file: str):
        super().__init__(model_file, "GPTSentencePieceTokenizer")


class Llama2Tokenizer(SentencePieceModelTokenizer):
    """Megatron's `--tokenizer-type Llama2Tokenizer`: the model's BOS id in front of every text."""

    def __init__(self, model_file: str):
        super().__init__(model_file, "Llama2Tokenizer")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *super().tokenize(text)]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in super().tokenize_batch(texts)]


class SentencePieceTokenizer(SentencePieceModelTokenizer):
    """Megatron's `--tokenizer-type SentencePieceTokenizer` (BERT/T5-style special tokens added)."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file, "SentencePieceTokenizer")
        self._special: dict[str, int] = {}
        self._cls, self._sep, self._eod, self._mask = (
            self._add_special(token) for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>")
        )
        self._pad, self._bos, self._eos = (
            self._add_special(self._model_piece(model_id, fallback))
            for model_id, fallback in (
                (self._sp.pad_id(), "<PAD>"),
                (self._sp.bos_id(), "<BOS>"),
                (self._sp.eos_id(), "<EOS>"),
            )
        )
        self.additional_special_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self.additional_special_tokens:
            self._add_special(token)
        self._inv_special = {i: token for token, i in self._special.items()}
        # Leftmost occurrence wins; at one position, the token added first (as Megatron's search does).
        self._special_pattern = re.compile("|".join(re.escape(token) for token in self._special))

    def _model_piece(self, model_id: int, fallback: str) -> str:
        """The model's piece for a control id, or `fallback` where the model has none (id -1)."""
        return self._sp.id_to_piece(model_id) if 0 <= model_id < self._sp.get_piece_size() else fallback

    def _add_special(self, token: str) -> int:
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
            self._inv_vocab[self._vocab[token]] = token
        self._special[token] = self._vocab[token]
        return self._vocab[token]

    def _split(self, text: str) -> list[str | int]:
        """The text as plain segments (str) and special-token ids (int), in order."""
        parts: list[str | int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            parts += [text[start : match.start()], self._special[match.group()]]
            start = match.end()
        parts.append(text[start:])
        return parts

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        split = [self._split(text) for text in texts]
        # One parallel encode of every plain segment of every text, then stitched back with the specials.
        encoded = iter(
            super().tokenize_batch([part for parts in split for part in parts if isinstance(part, str)])
        )
        batch = []
        for parts in split:
            ids: list[int] = []
            for part in parts:
                if isinstance(part, int):
                    ids.append(part)
                else:
                    ids += next(encoded)
            batch.append(ids)
        return batch

    def detokenize(self, ids: Sequence[int]) -> str:
        """Plain runs decoded by the model; each special token written out between spaces (as Megatron)."""
        text, run = "", []
        for i in ids:
            if i in self._inv_special:
                text += self._sp.decode(run) + " " + self._inv_special[i] + " "
                run = []
            else:
                run.append(i)
        return text + self._sp.decode(run)

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return [self._vocab[token] for token in self.additional_special_tokens]

    cls = stored_id("_cls")
    sep = stored_id("_sep")
    mask = stored_id("_mask")
    pad = stored_id("_pad")
    bos = stored_id("_bos")
    eos = stored_id("_eos")
    eod = stored_id("_eod")
