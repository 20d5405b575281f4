"""A small sentence-split WordPiece corpus for the BERT and T5 dataset tests, built from scratch.

The vocabulary holds two-letter stems and their "##" continuations, so a word of k stems tokenizes to
k pieces: whole-word masking has multi-piece words to keep together. `slow_bert` is the reference tokenizer:
transformers' pure-Python one.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_train.tokenizer.bert import BertWordPieceTokenizer
from storage.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."]
STEMS = [consonant + vowel for consonant in "bdfgklmnprstvz" for vowel in "aeiou"]


def write_vocab(path: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join([*SPECIAL_TOKENS, *STEMS, *(f"##{stem}" for stem in STEMS)]) + "\n")
    return path


def build_tokenizer(directory, vocab_extra_ids: int = 0) -> BertWordPieceTokenizer:
    return BertWordPieceTokenizer(write_vocab(str(directory / "vocab.txt")), vocab_extra_ids=vocab_extra_ids)


def random_sentence(rng: np.random.Generator) -> str:
    words = ["".join(rng.choice(STEMS, size=rng.integers(1, 4))) for _ in range(rng.integers(4, 14))]
    return " ".join(words) + " ."


def write_sentence_corpus(
    prefix: str, tokenizer: BertWordPieceTokenizer, num_documents: int, seed: int = 0
) -> list[list[list[int]]]:
    """Write `<prefix>.bin/.idx` of documents of 1 to 8 tokenized sentences; returns their token ids."""
    rng = np.random.default_rng(seed)
    documents = [
        [tokenizer.tokenize(random_sentence(rng)) for _ in range(rng.integers(1, 9))]
        for _ in range(num_documents)
    ]
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    for sentences in documents:
        for sentence in sentences:
            builder.add_item(sentence)
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return documents


def write_wordpiece_corpus(directory, num_documents: int, vocab_extra_ids: int = 0) -> tuple[str, str]:
    """(vocab file, --data-path prefix) of a sentence-split corpus of `num_documents` written in `directory`."""
    prefix = str(directory / "corpus_text_sentence")
    write_sentence_corpus(prefix, build_tokenizer(directory, vocab_extra_ids), num_documents)
    return str(directory / "vocab.txt"), prefix


def slow_bert(vocab_file, lower_case: bool):
    """transformers' pure-Python BERT tokenizer (the legacy class in transformers 5)."""
    pytest.importorskip("transformers")
    try:
        from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy as SlowBert
    except ImportError:
        from transformers import BertTokenizer as SlowBert
    return SlowBert(str(vocab_file), do_lower_case=lower_case)
