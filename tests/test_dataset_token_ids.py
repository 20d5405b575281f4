"""Token ids beyond the tokenizer's vocabulary are refused when a dataset is built (pretrain_gpt, pretrain_bert,
pretrain_t5), naming the file, the document and the id, instead of an IndexError in the embedding at the first
step; the scan is cached beside the dataset indices."""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron_train.data.bert_dataset import BERTDatasetConfig
from megatron_train.data.builder import (
    build_masked_train_valid_test_datasets,
    build_train_valid_test_datasets,
)
from megatron_train.data.config import DataConfig
from megatron_train.data.t5_dataset import T5DatasetConfig
from storage.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path
from tests.helpers.wordpiece_corpus import build_tokenizer, write_sentence_corpus


def _with_a_foreign_token(prefix: str, documents: list[list[list[int]]], document: int, token: int) -> None:
    """Rewrite the corpus with `token` (an id of another tokenizer) in the first sentence of `document`."""
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    for number, sentences in enumerate(documents):
        for index, sentence in enumerate(sentences):
            builder.add_item([token, *sentence[1:]] if (number, index) == (document, 0) else sentence)
        builder.end_document()
    builder.finalize(index_file_path(prefix))


@pytest.mark.parametrize("kind", ["bert", "t5", "gpt"])
def test_a_token_id_beyond_the_vocabulary_is_refused_when_the_dataset_is_built(tmp_path, kind):
    tokenizer = build_tokenizer(tmp_path, vocab_extra_ids=100 if kind == "t5" else 0)
    prefix = str(tmp_path / "corpus_text_sentence")
    documents = write_sentence_corpus(prefix, tokenizer, 60)
    data = DataConfig(data_path=[prefix], split="90,10,0", data_cache_path=str(tmp_path / "cache"))

    def build():
        if kind == "gpt":
            return build_train_valid_test_datasets(
                data, 16, (20, 2, 0), 1, tokenizer.eod, tokenizer.vocab_size
            )
        settings = {"seq_length": 64, "seed": 1, "tokenizer": tokenizer}
        config = (
            BERTDatasetConfig(**settings)
            if kind == "bert"
            else T5DatasetConfig(**settings, decoder_seq_length=32)
        )
        return build_masked_train_valid_test_datasets(data, config, (20, 2, 0))

    build()  # in the vocabulary: builds, and caches the scan
    cached = [name for name in os.listdir(tmp_path / "cache") if "TokenIdRange" in name]
    assert len(cached) == 2  # the range and its description
    _with_a_foreign_token(prefix, documents, document=7, token=tokenizer.vocab_size + 5)
    with pytest.raises(ValueError) as refused:
        build()
    sequence = sum(len(sentences) for sentences in documents[:7])
    assert str(refused.value) == (
        f"{prefix}.bin: document 7 (sequence {sequence}) holds token id {tokenizer.vocab_size + 5}, outside the "
        f"tokenizer's {tokenizer.vocab_size} ids: the data was tokenized with another tokenizer; tokenize it again "
        "with this one, or pass the tokenizer flags it was made with"
    )
