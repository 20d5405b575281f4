"""A small GPT corpus for the Retro tests: word-level GPT tokens over the WordPiece test stems.

`WordTokenizer` is a GPT-style tokenizer whose ids are whole words (" ba", " keto", ...) plus a newline
and an EOD: its text re-tokenizes cleanly with the test BERT vocabulary (`tests.helpers.wordpiece_corpus`), and
a chunk of newlines only re-tokenizes to nothing (an invalid chunk). Documents are drawn from topics
(each a subset of the words), so `topic_embed` gives clustered vectors for the index tests.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megatron_train.tokenizer import MegatronTokenizer
from retro.config import IndexConfig
from storage.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path
from tests.helpers.wordpiece_corpus import STEMS

EOD, NEWLINE = 0, 1
WORDS = [" <eod>", "\n", *(f" {stem}" for stem in STEMS)]
NUM_TOPICS = 8
INDEX_CONFIG = IndexConfig(retro_index_str="IVF16,Flat", retro_index_ntrain=1200, retro_block_size=500)


class WordTokenizer(MegatronTokenizer):
    """GPT-side tokenizer of the test corpus: one id per word."""

    @property
    def vocab_size(self) -> int:
        return len(WORDS)

    @property
    def vocab(self) -> dict[str, int]:
        return {word: i for i, word in enumerate(WORDS)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        return dict(enumerate(WORDS))

    def tokenize(self, text: str) -> list[int]:
        vocab = self.vocab
        return [
            NEWLINE if word == "\n" else vocab[f" {word}"]
            for word in text.replace("\n", " \n ").split(" ")
            if word
        ]

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(WORDS[i] for i in ids)

    @property
    def eod(self) -> int:
        return EOD


def topic_documents(
    num_documents: int, seed: int = 0, min_length: int = 20, max_length: int = 200
) -> list[np.ndarray]:
    """Documents of words from one of NUM_TOPICS topics each, ending with EOD."""
    rng = np.random.default_rng(seed)
    word_ids = np.arange(2, len(WORDS))
    topics = [rng.choice(word_ids, size=12, replace=False) for _ in range(NUM_TOPICS)]
    documents = []
    for _ in range(num_documents):
        words = rng.choice(topics[rng.integers(NUM_TOPICS)], size=rng.integers(min_length, max_length))
        documents.append(np.append(words, EOD))
    return documents


def write_corpus(prefix: str, documents: Sequence[Sequence[int]]) -> str:
    """`<prefix>.bin/.idx` with one sequence per document (as the tokenize stage writes GPT data)."""
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    for tokens in documents:
        builder.add_item(np.asarray(tokens, dtype=np.int64))
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return prefix


def topic_embed(texts: list[str]) -> np.ndarray:
    """Deterministic embedding: each word's fixed random vector, averaged over the text (float32 [n, 32])."""
    table = np.random.default_rng(1234).standard_normal((len(WORDS), 32)).astype(np.float32)
    vocab = {word.strip(): i for i, word in enumerate(WORDS)}
    vectors = np.zeros((len(texts), 32), dtype=np.float32)
    for row, text in enumerate(texts):
        ids = [vocab[word] for word in text.split()]
        if ids:
            vectors[row] = table[ids].mean(axis=0)
    return vectors


def topic_texts(num_documents: int, seed: int = 0, min_length: int = 20, max_length: int = 200) -> list[str]:
    """`topic_documents` as text (EOD dropped): JSON Lines input for the tokenize stage."""
    return [
        "".join(WORDS[i] for i in doc[:-1]).strip()
        for doc in topic_documents(num_documents, seed, min_length, max_length)
    ]


def write_tiny_embedder(directory: str, hidden: int = 32) -> str:
    """A Hugging Face BertModel directory (random weights, seed 0) with the WordPiece test vocabulary."""
    import torch
    import transformers

    from tests.helpers.wordpiece_corpus import write_vocab

    os.makedirs(directory, exist_ok=True)
    vocab = write_vocab(f"{directory}/vocab.txt")
    with open(vocab, encoding="utf-8") as f:
        vocab_size = sum(1 for _ in f)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * hidden, max_position_embeddings=128,
    )  # fmt: skip
    transformers.BertModel(config).save_pretrained(directory)
    return directory


class CountingEmbed:
    """`topic_embed` that counts the texts it embeds; at call `fail_at` it raises (a crash mid-fill), or
    with `kill` SIGKILLs its own process."""

    def __init__(self, fail_at: int | None = None, kill: bool = False) -> None:
        self.fail_at, self.kill, self.calls, self.texts = fail_at, kill, 0, 0

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        if self.calls == self.fail_at:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("crash while embedding a block")
        self.texts += len(texts)
        return topic_embed(texts)


def write_jsonl(path: Path, records: list[dict]) -> str:
    """`records` as JSON lines in `path` (QA and SFT task files); returns the path."""
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)
