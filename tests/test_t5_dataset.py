"""T5Dataset: span corruption statistics, sentinel layout, masks, determinism and caching."""

from __future__ import annotations

import glob
import itertools
import logging

import numpy as np
import pytest

from megatron_train.data.builder import build_masked_train_valid_test_datasets
from megatron_train.data.config import DataConfig
from megatron_train.data.samplers import build_pretraining_data_loader
from megatron_train.data.t5_dataset import T5Dataset, T5DatasetConfig, max_noise_tokens, random_noise_spans
from tests.helpers.wordpiece_corpus import build_tokenizer, write_sentence_corpus

NUM_STATISTICS_SAMPLES = 10_000


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("vocab"), vocab_extra_ids=100)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer):
    prefix = str(tmp_path_factory.mktemp("t5-corpus") / "corpus_text_sentence")
    write_sentence_corpus(prefix, tokenizer, 400)
    return prefix


def t5_datasets(corpus, tokenizer, cache, num_samples=(200, 20, 0), split="90,10,0", **config):
    data_config = DataConfig(data_path=[corpus], split=split, data_cache_path=str(cache))
    settings = {"seq_length": 64, "decoder_seq_length": 32, "seed": 1234, "tokenizer": tokenizer, **config}
    return build_masked_train_valid_test_datasets(data_config, T5DatasetConfig(**settings), num_samples)


def decode(sample, tokenizer):
    """(encoder tokens, decoder tokens, original tokens rebuilt from the two, spans) of one sample."""
    encoder = sample["text_enc"][: int(sample["enc_mask"].sum())].tolist()
    decoder = sample["text_dec"][: int(sample["loss_mask"].sum())].tolist()
    sentinels = set(tokenizer.additional_special_tokens_ids)
    spans: list[list[int]] = []
    for token in decoder[1:]:
        if token in sentinels:
            spans.append([])
        else:
            spans[-1].append(token)
    original = []
    for token in encoder:
        original += (
            spans[tokenizer.additional_special_tokens_ids.index(token)] if token in sentinels else [token]
        )
    return encoder, decoder, original, spans


def test_random_noise_spans_follow_t5():
    rng = np.random.RandomState(0)
    for length in (2, 3, 10, 61, 126, 510):
        for _ in range(20):
            spans = random_noise_spans(length, 0.15, 3.0, rng)
            assert sum(end - start for start, end in spans) == max_noise_tokens(length, 0.15)
            assert spans[0][0] > 0 and spans[-1][1] <= length  # a kept run comes first
            assert all(end < start for (_, end), (start, _) in itertools.pairwise(spans))  # never adjacent
    # T5 would round 126 * 0.15 / 3 = 6.3 spans to 6 (mean 3.17); at random rounding the mean is 3.
    counts = [len(random_noise_spans(126, 0.15, 3.0, rng)) for _ in range(4000)]
    assert set(counts) == {6, 7} and abs(19 / np.mean(counts) - 3.0) < 0.05


def test_noise_density_and_mean_span_length_over_10k_samples(corpus, tokenizer, tmp_path):
    train, _, _ = t5_datasets(
        corpus,
        tokenizer,
        tmp_path,
        (NUM_STATISTICS_SAMPLES, 0, 0),
        "1",
        seq_length=128,
        decoder_seq_length=64,
    )
    noise = tokens = spans = 0
    for idx in range(NUM_STATISTICS_SAMPLES):
        _, _, original, sample_spans = decode(train[idx], tokenizer)
        tokens += len(original)
        noise += sum(map(len, sample_spans))
        spans += len(sample_spans)
    # Within 1% of the configured rates (measured: noise 0.1507, mean span 2.977 tokens).
    assert abs(noise / tokens / 0.15 - 1) < 0.01
    assert abs(noise / spans / 3.0 - 1) < 0.01


def test_sample_layout(corpus, tokenizer, tmp_path):
    train, valid, test = t5_datasets(corpus, tokenizer, tmp_path)
    assert isinstance(train, T5Dataset) and len(valid) >= 20 and test is None
    sentinel_ids = tokenizer.additional_special_tokens_ids
    assert [tokenizer.inv_vocab[i] for i in sentinel_ids[:2]] == ["<extra_id_0>", "<extra_id_1>"]
    for idx in range(len(train)):
        sample = train[idx]
        assert sorted(sample) == sorted(
            [
                "text_enc",
                "text_dec",
                "labels",
                "loss_mask",
                "truncated",
                "enc_mask",
                "dec_mask",
            ]
        )
        encoder, decoder, original, spans = decode(sample, tokenizer)
        sentences, target, _ = train.sample_sentences(idx)
        source = [token for sentence in sentences for token in sentence]
        assert original == source[:target] and sample["truncated"] == int(len(source) > target)

        # Sentinels <extra_id_0>, <extra_id_1>, ... in order, the same ones in encoder and decoder.
        used = sentinel_ids[: len(spans)]
        assert [token for token in encoder if token in sentinel_ids] == used
        assert decoder[0] == tokenizer.bos and [token for token in decoder if token in sentinel_ids] == used
        # Labels are the decoder input shifted by one, ending in [EOS]; -1 past them.
        n = len(decoder)
        np.testing.assert_array_equal(sample["labels"][: n - 1], sample["text_dec"][1:n])
        assert sample["labels"][n - 1] == tokenizer.eos and (sample["labels"][n:] == -1).all()
        assert not sample["text_enc"][len(encoder) :].any() and not sample["text_dec"][n:].any()

        enc_tokens = np.arange(64) < len(encoder)
        dec_tokens = np.arange(32) < n
        np.testing.assert_array_equal(sample["loss_mask"], dec_tokens)
        np.testing.assert_array_equal(sample["enc_mask"], enc_tokens)  # Megatron-Core's 1-D padding masks
        np.testing.assert_array_equal(sample["dec_mask"], dec_tokens)


def test_same_seed_same_samples_other_seed_differs(corpus, tokenizer, tmp_path):
    first, _, _ = t5_datasets(corpus, tokenizer, tmp_path / "a")
    again, _, _ = t5_datasets(corpus, tokenizer, tmp_path / "b")
    other, _, _ = t5_datasets(corpus, tokenizer, tmp_path / "c", seed=99)
    for idx in (0, 5, 199):
        for key, value in first[idx].items():
            np.testing.assert_array_equal(value, again[idx][key])
    assert any(not np.array_equal(first[i]["text_enc"], other[i]["text_enc"]) for i in range(10))


def test_cached_sample_index_is_reused(corpus, tokenizer, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_train.data.indices"):
        first, _, _ = t5_datasets(corpus, tokenizer, tmp_path)
        assert "T5Dataset-train indices built" in caplog.text
        caplog.clear()
        second, _, _ = t5_datasets(corpus, tokenizer, tmp_path)
        assert "T5Dataset-train indices loaded from cache" in caplog.text and "built" not in caplog.text
    np.testing.assert_array_equal(first.sample_index, second.sample_index)
    assert len(glob.glob(str(tmp_path / "*-T5Dataset-*-description.txt"))) == 2


def test_settings_that_cannot_fit_are_named(tokenizer, tmp_path):
    with pytest.raises(
        ValueError, match="--decoder-seq-length 16 is too short.*give --decoder-seq-length 27"
    ):
        T5DatasetConfig(seq_length=128, decoder_seq_length=16, seed=1, tokenizer=tokenizer)
    few_sentinels = build_tokenizer(tmp_path, vocab_extra_ids=3)
    with pytest.raises(ValueError, match="--vocab-extra-ids 3: .* give --vocab-extra-ids 7"):
        T5DatasetConfig(seq_length=128, decoder_seq_length=64, seed=1, tokenizer=few_sentinels)


def test_data_loader_batches(corpus, tokenizer, tmp_path):
    train, _, _ = t5_datasets(corpus, tokenizer, tmp_path)
    batch = next(iter(build_pretraining_data_loader(train, 0, 4, 0, 1)))
    assert {key: tuple(value.shape) for key, value in batch.items()} == {
        "text_enc": (4, 64),
        "text_dec": (4, 32),
        "labels": (4, 32),
        "loss_mask": (4, 32),
        "truncated": (4,),
        "enc_mask": (4, 64),
        "dec_mask": (4, 32),
    }
    np.testing.assert_array_equal(batch["text_enc"][3].numpy(), train[3]["text_enc"])


def test_per_split_data_paths(corpus, tokenizer, tmp_path):
    data_config = DataConfig(
        train_data_path=[corpus], valid_data_path=["1", corpus], data_cache_path=str(tmp_path)
    )
    config = T5DatasetConfig(seq_length=64, decoder_seq_length=32, seed=7, tokenizer=tokenizer)
    train, valid, test = build_masked_train_valid_test_datasets(data_config, config, (50, 10, 0))
    assert isinstance(train, T5Dataset) and test is None
    assert train.documents[0] == 0 and train.documents[-1] == 399  # each split's blend is used whole
    assert train.config.split == "per-split data paths" and len(valid) >= 10  # whole epochs
