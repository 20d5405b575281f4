"""Train a tokenizer from a stream of texts, for users who have no vocabulary.

The files written are the ones the matching `--tokenizer-type` reads: GPT-2 style vocab.json + merges.txt
(GPT2BPETokenizer, and transformers' GPT2Tokenizer) plus a tokenizer.json (HuggingFaceTokenizer); or a
BERT vocab.txt (BertWordPieceLowerCase / BertWordPieceCase). Training streams: `texts` may be any iterator.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence

from tokenizers import models, pre_tokenizers, trainers

from megatron_train.tokenizer.bert import UNK_TOKEN, wordpiece
from megatron_train.tokenizer.gpt2 import byte_level_bpe

log = logging.getLogger(__name__)


class _Counted:
    """Passes texts through, counting them and their characters for the throughput log."""

    def __init__(self, texts: Iterable[str]):
        self._texts = texts
        self.texts = 0
        self.chars = 0

    def __iter__(self) -> Iterator[str]:
        for text in self._texts:
            self.texts += 1
            self.chars += len(text)
            yield text


def _log_throughput(kind: str, counted: _Counted, started: float, vocab_size: int) -> None:
    seconds = max(time.perf_counter() - started, 1e-9)
    log.info(
        "trained %s tokenizer (vocab %d) on %d texts, %.1f M characters in %.1f s (%.2f M characters/s)",
        kind, vocab_size, counted.texts, counted.chars / 1e6, seconds, counted.chars / 1e6 / seconds,
    )  # fmt: skip


def train_byte_level_bpe(
    texts: Iterable[str],
    out_dir: str,
    vocab_size: int = 32000,
    special_tokens: Sequence[str] = ("<|endoftext|>",),
    min_frequency: int = 2,
) -> dict[str, str]:
    """Train GPT-2 style byte-level BPE; write vocab.json, merges.txt, tokenizer.json, tokenizer_config.json.

    The first special token is the end-of-document token (GPT2BPETokenizer requires "<|endoftext|>").
    Returns {"vocab_file", "merge_file", "tokenizer_json", "tokenizer_config"}: paths in `out_dir`.
    """
    if not special_tokens:
        raise ValueError("special_tokens must name at least the end-of-document token, e.g. '<|endoftext|>'")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = byte_level_bpe(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    counted = _Counted(texts)
    started = time.perf_counter()
    tokenizer.train_from_iterator(counted, trainer=trainer)
    _log_throughput("byte-level BPE", counted, started, tokenizer.get_vocab_size())
    vocab_file, merge_file = tokenizer.model.save(out_dir)
    tokenizer_json = os.path.join(out_dir, "tokenizer.json")
    tokenizer.save(tokenizer_json)
    tokenizer_config = os.path.join(out_dir, "tokenizer_config.json")
    with open(tokenizer_config, "w", encoding="utf-8") as f:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": special_tokens[0]}
        json.dump(config, f, indent=2, sort_keys=True)
    return {
        "vocab_file": vocab_file,
        "merge_file": merge_file,
        "tokenizer_json": tokenizer_json,
        "tokenizer_config": tokenizer_config,
    }


def train_wordpiece(
    texts: Iterable[str],
    out_dir: str,
    vocab_size: int = 30522,
    lowercase: bool = True,
    special_tokens: Sequence[str] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"),
    min_frequency: int = 0,
) -> dict[str, str]:
    """Train a BERT WordPiece vocabulary with BERT's normalisation; write vocab.txt.

    Use the result with BertWordPieceLowerCase when `lowercase`, else BertWordPieceCase, which need
    [PAD], [UNK], [CLS], [SEP] and [MASK]. Pairs seen fewer than `min_frequency` times are not merged.
    Returns {"vocab_file": path of vocab.txt}.
    """
    if UNK_TOKEN not in special_tokens:
        raise ValueError(f"special_tokens must include {UNK_TOKEN!r}: WordPiece maps unknown words to it")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = wordpiece({}, strip_accents=lowercase)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        show_progress=True,
    )
    counted = _Counted(texts)
    # Lower-case in Python, as BertWordPieceTokenizer does when it encodes.
    stream = (text.lower() for text in counted) if lowercase else iter(counted)
    started = time.perf_counter()
    tokenizer.train_from_iterator(stream, trainer=trainer)
    _log_throughput("WordPiece", counted, started, tokenizer.get_vocab_size())
    (vocab_file,) = tokenizer.model.save(out_dir)
    return {"vocab_file": vocab_file}
