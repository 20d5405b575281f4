"""GPTDataset, BlendedDataset and the builder against brute-force ports of Megatron-Core's algorithms."""

from __future__ import annotations

import glob
import logging
import math
import os

import numpy as np
import pytest

from megatron_train.data.blended import BlendedDataset
from megatron_train.data.builder import build_train_valid_test_datasets
from megatron_train.data.config import DataConfig, parse_blend, parse_split, split_matrix
from megatron_train.data.gpt_dataset import GPTDataset, GPTDatasetConfig, Split
from megatron_train.data.indices import build_blending_indices, build_sample_index
from megatron_train.data.mock import MockSequences
from storage.indexed_dataset import IndexedDataset
from tests.helpers.gpt_dataset import (
    EOD,
    random_documents,
    reference_blend,
    reference_indices,
    reference_sample_index,
    write_dataset,
)

# ---------------------------------------------------------------- brute-force references (pure Python)


# ---------------------------------------------------------------- data on disk


@pytest.fixture
def corpus(tmp_path):
    """60 documents of 1-3 sequences: 121 sequences of about 20 tokens."""
    return write_dataset(
        str(tmp_path / "corpus_text_document"), random_documents(np.random.default_rng(7), 60)
    )


def stream_of(sequences, document_index):
    return np.concatenate([sequences.get(int(d)) for d in document_index]).astype(np.int64)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "seed, num_samples, seq_length, epochs, separate_final_epoch",
    [
        (1234, 10, 16, 1, False),
        (5, 200, 8, 1, False),
        (99, 33, 64, 2, True),
        (4, 700, 8, 3, False),
        (21, 500, 16, 5, True),
    ],
)
def test_indices_and_samples_match_megatron(
    corpus, tmp_path, seed, num_samples, seq_length, epochs, separate_final_epoch
):
    prefix = corpus
    sequences = IndexedDataset(prefix)
    config = DataConfig(data_path=[prefix], split="80,15,5", data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(config, seq_length, (num_samples, 5, 2), seed, EOD)

    bookends = split_matrix(parse_split("80,15,5"))
    previous_end = 0
    for dataset, bookend in zip((train, valid, test), bookends, strict=True):
        begin, end = round(bookend[0] * len(sequences)), round(bookend[1] * len(sequences))
        assert begin == previous_end and list(dataset.documents) == list(range(begin, end))
        previous_end = end
    assert previous_end == len(sequences)

    doc_index, sample_index, shuffle_index, separate = reference_indices(
        sequences.sequence_lengths, train.documents, num_samples, seq_length, seed
    )
    assert len(doc_index) == epochs * len(train.documents) and separate == separate_final_epoch
    np.testing.assert_array_equal(train.document_index, doc_index)
    np.testing.assert_array_equal(train.sample_index, sample_index)
    np.testing.assert_array_equal(train.shuffle_index, shuffle_index)
    assert len(train) >= num_samples

    # Every sample is its window of the concatenated epochs' token stream, shuffled by shuffle_index.
    stream = stream_of(sequences, train.document_index)
    for i in range(len(train)):
        j = int(train.shuffle_index[i])
        item = train[i]
        np.testing.assert_array_equal(item["tokens"], stream[j * seq_length : (j + 1) * seq_length])
        np.testing.assert_array_equal(item["labels"], stream[j * seq_length + 1 : (j + 1) * seq_length + 1])
        np.testing.assert_array_equal(item["position_ids"], np.arange(seq_length))
        assert item["loss_mask"].dtype == np.float32 and item["loss_mask"].all()


def test_every_split_document_appears_once_per_epoch(corpus, tmp_path):
    prefix = corpus
    config = DataConfig(data_path=[prefix], split="90,10,0", data_cache_path=str(tmp_path))
    train, valid, test = build_train_valid_test_datasets(config, 16, (400, 3, 3), 5, EOD)
    assert test is None  # a 0 share of --split gives no dataset
    epochs = len(train.document_index) // len(train.documents)
    assert epochs > 2
    counts = np.bincount(train.document_index, minlength=len(IndexedDataset(prefix)))
    assert set(counts[train.documents]) == {epochs} and counts.sum() == epochs * len(train.documents)


def test_separate_final_epoch_is_shuffled_apart(corpus):
    prefix = corpus
    sequences = IndexedDataset(prefix)
    documents = np.arange(len(sequences), dtype=np.int32)
    tokens_per_epoch = int(sequences.sequence_lengths.sum())
    seq_length = 16
    num_samples = (2 * tokens_per_epoch) // seq_length + 2  # just into a third epoch: kept apart
    config = GPTDatasetConfig(seq_length=seq_length, seed=3, eod=EOD, split="1")
    dataset = GPTDataset(sequences, prefix, documents, num_samples, Split.train, config, cache_dir=None)
    _, _, shuffle_index, separate = reference_indices(
        sequences.sequence_lengths, documents, num_samples, seq_length, 3
    )
    assert separate
    np.testing.assert_array_equal(dataset.shuffle_index, shuffle_index)
    sans_final = (2 * tokens_per_epoch - 1) // seq_length
    assert sorted(dataset.shuffle_index[:sans_final]) == list(range(sans_final))
    # The first two epochs' documents are shuffled together, the third epoch's on their own.
    first_two = dataset.document_index[: 2 * len(documents)]
    np.testing.assert_array_equal(np.bincount(first_two), np.full(len(documents), 2))


def test_sample_index_matches_cpp_port_on_edge_cases():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(300):
        sizes = rng.integers(0, 15, rng.integers(1, 25)).astype(np.int32)  # includes empty sequences
        seq_length, epochs = int(rng.integers(2, 10)), int(rng.integers(1, 4))
        extra, drop_last = int(rng.integers(0, 2)), bool(rng.integers(0, 2))
        tokens_per_epoch = int(sizes.sum())
        if epochs * tokens_per_epoch - extra < seq_length:
            continue
        document_index = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
        rng.shuffle(document_index)
        expected = reference_sample_index(
            sizes, document_index, seq_length, epochs, tokens_per_epoch, drop_last, extra
        )
        for chunk_size in (1, 3, 1 << 20):  # documents per vectorised chunk
            ours = build_sample_index(
                sizes,
                document_index,
                seq_length,
                epochs,
                tokens_per_epoch,
                drop_last,
                bool(extra),
                chunk_size,
            )
            np.testing.assert_array_equal(ours, expected)
            assert ours.dtype == np.int32
        checked += 1
    assert checked > 200


def test_partial_validation_sample_is_padded_and_masked(corpus):
    prefix = corpus
    sequences = IndexedDataset(prefix)
    documents = np.arange(10, dtype=np.int32)
    tokens = int(sequences.sequence_lengths[:10].sum())
    seq_length = 7 if (tokens - 1) % 7 else 6  # leaves a partial last sample
    config = GPTDatasetConfig(
        seq_length=seq_length, seed=1, eod=EOD, split="1", drop_last_partial_validation_sequence=False
    )
    dataset = GPTDataset(sequences, prefix, documents, None, Split.valid, config, cache_dir=None)
    assert len(dataset) == math.ceil((tokens - 1) / seq_length)
    last = len(dataset) - 1
    item = dataset[int(np.nonzero(dataset.shuffle_index == last)[0][0])]
    text = stream_of(sequences, dataset.document_index)[last * seq_length :]
    padded = np.concatenate([text, np.zeros(seq_length + 1 - len(text), dtype=np.int64)])
    np.testing.assert_array_equal(item["tokens"], padded[:-1])
    np.testing.assert_array_equal(item["labels"], padded[1:])
    real_labels = len(text) - 1
    assert 0 < real_labels < seq_length
    np.testing.assert_array_equal(item["loss_mask"], np.arange(seq_length) < real_labels)


def test_eod_mask_loss_reset_position_ids_and_attention_mask(corpus, tmp_path):
    prefix = corpus
    config = DataConfig(
        data_path=[prefix],
        split="1",
        data_cache_path=str(tmp_path),
        eod_mask_loss=True,
        reset_position_ids=True,
        reset_attention_mask=True,
    )
    train, _, _ = build_train_valid_test_datasets(config, 64, (20, 0, 0), 1, EOD)
    seen_eod = 0
    for i in range(len(train)):
        item = train[i]
        tokens = item["tokens"]
        np.testing.assert_array_equal(item["loss_mask"], (tokens != EOD).astype(np.float32))
        expected, position, documents, document = [], 0, [], 0
        for token in tokens:
            expected.append(position)
            documents.append(document)  # an eod belongs to the document it ends
            position = 0 if token == EOD else position + 1
            document += int(token == EOD)
        np.testing.assert_array_equal(item["position_ids"], expected)
        np.testing.assert_array_equal(item["document_ids"], documents)
        seen_eod += int((tokens == EOD).sum())
    assert seen_eod > 0
    plain = DataConfig(data_path=[prefix], split="1", data_cache_path=str(tmp_path))
    assert "document_ids" not in build_train_valid_test_datasets(plain, 64, (20, 0, 0), 1, EOD)[0][0]


def test_cache_is_reused_and_keyed_by_everything(corpus, tmp_path, caplog):
    prefix = corpus
    cache = tmp_path / "index-cache"
    config = DataConfig(data_path=[prefix], split="80,20,0", data_cache_path=str(cache))
    with caplog.at_level(logging.INFO, logger="megatron_train.data.indices"):
        first, _, _ = build_train_valid_test_datasets(config, 16, (50, 4, 0), 11, EOD)
        assert "GPTDataset-train indices built" in caplog.text
        caplog.clear()
        second, _, _ = build_train_valid_test_datasets(config, 16, (50, 4, 0), 11, EOD)
        assert "GPTDataset-train indices loaded from cache" in caplog.text and "built" not in caplog.text
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
        assert isinstance(getattr(second, name), np.memmap)
    assert len(glob.glob(str(cache / "*-description.txt"))) == 2  # train and valid

    changed, _, _ = build_train_valid_test_datasets(config, 16, (50, 4, 0), 12, EOD)  # another seed
    assert changed.unique_description != first.unique_description
    assert not np.array_equal(changed.shuffle_index, first.shuffle_index)
    build_train_valid_test_datasets(config, 32, (50, 4, 0), 11, EOD)  # another sequence length
    build_train_valid_test_datasets(config, 16, (60, 4, 0), 11, EOD)  # another train sample count
    # Seed and sequence length re-key both splits; the train sample count re-keys train only.
    assert len(glob.glob(str(cache / "*-description.txt"))) == 2 + 2 + 2 + 1
    assert not glob.glob(str(cache / "*.tmp-*"))


def test_rewritten_data_gets_new_indices(tmp_path, caplog):
    prefix = str(tmp_path / "rewritten")
    config = DataConfig(data_path=[prefix], split="1", data_cache_path=str(tmp_path / "cache"))
    write_dataset(prefix, random_documents(np.random.default_rng(1), 20))
    first, _, _ = build_train_valid_test_datasets(config, 16, (10, 0, 0), 1, EOD)
    write_dataset(prefix, random_documents(np.random.default_rng(2), 20))  # same path, other lengths
    with caplog.at_level(logging.INFO, logger="megatron_train.data.indices"):
        second, _, _ = build_train_valid_test_datasets(config, 16, (10, 0, 0), 1, EOD)
    assert "indices built" in caplog.text and "loaded from cache" not in caplog.text
    assert second.unique_description != first.unique_description


def test_default_cache_dir_is_beside_the_data(corpus):
    prefix = corpus
    build_train_valid_test_datasets(DataConfig(data_path=[prefix], split="1"), 16, (5, 0, 0), 1, EOD)
    cache = os.path.join(os.path.dirname(prefix), "cache")
    assert len(glob.glob(os.path.join(cache, "*-GPTDataset-train-description.txt"))) == 1


@pytest.mark.parametrize("num_datasets", [1, 2, 3, 7], ids=lambda n: f"{n}_datasets")
@pytest.mark.parametrize("size", [1, 5, 257, 3000], ids=lambda n: f"{n}_samples")
def test_blending_indices_equal_megatron_greedy(num_datasets, size):
    weights = np.random.default_rng([3, num_datasets, size]).random(num_datasets) + 0.01
    expected = reference_blend(weights, size)
    for segment_length in (None, 5, 64):
        dataset_index, dataset_sample_index = build_blending_indices(weights, size, segment_length, warmup=3)
        np.testing.assert_array_equal(dataset_index, expected[0], err_msg=f"segment_length={segment_length}")
        np.testing.assert_array_equal(
            dataset_sample_index, expected[1], err_msg=f"segment_length={segment_length}"
        )
        assert dataset_index.dtype == np.int16 and dataset_sample_index.dtype == np.int64


def test_blending_proportions_at_scale():
    weights = [0.2, 0.5, 0.3]
    dataset_index, dataset_sample_index = build_blending_indices(weights, 200_000)
    counts = np.bincount(dataset_index)
    np.testing.assert_allclose(counts / 200_000, weights, atol=1e-4)
    for i in range(3):
        np.testing.assert_array_equal(dataset_sample_index[dataset_index == i], np.arange(counts[i]))


def test_weighted_blend_through_builder(tmp_path):
    rng = np.random.default_rng(11)
    prefixes = [write_dataset(str(tmp_path / f"d{i}"), random_documents(rng, 40)) for i in range(2)]
    config = DataConfig(
        data_path=["0.3", prefixes[0], "0.7", prefixes[1]],
        split="90,10,0",
        data_cache_path=str(tmp_path / "c"),
    )
    train, valid, _ = build_train_valid_test_datasets(config, 16, (100, 10, 0), 1234, EOD)
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset)
    # Megatron's sizes: each dataset builds ceil(ceil(n * w) * 1.005) samples; the blend has sum(ceil(n * w)).
    assert len(train) == math.ceil(100 * 0.3) + math.ceil(100 * 0.7)
    assert [d.num_samples for d in train.datasets] == [math.ceil(30 * 1.005), math.ceil(70 * 1.005)]
    np.testing.assert_array_equal(train.dataset_index, reference_blend([0.3, 0.7], len(train))[0])
    for i in range(len(train)):
        source = train.datasets[int(train.dataset_index[i])][int(train.dataset_sample_index[i])]
        np.testing.assert_array_equal(train[i]["tokens"], source["tokens"])
    again, _, _ = build_train_valid_test_datasets(config, 16, (100, 10, 0), 1234, EOD)
    assert isinstance(again.dataset_index, np.memmap)
    np.testing.assert_array_equal(again.dataset_sample_index, train.dataset_sample_index)


def test_unweighted_blend_and_per_split_paths(tmp_path):
    rng = np.random.default_rng(12)
    prefixes = [write_dataset(str(tmp_path / f"d{i}"), random_documents(rng, 20 * (i + 1))) for i in range(2)]
    config = DataConfig(
        train_data_path=prefixes, valid_data_path=[prefixes[0]], data_cache_path=str(tmp_path)
    )
    train, valid, test = build_train_valid_test_datasets(config, 16, (30, 5, 5), 1, EOD)
    assert test is None
    lengths = [len(d) for d in train.datasets]  # one epoch each, weighted by size
    assert len(train) == 30 and train.weights == pytest.approx([n / sum(lengths) for n in lengths])
    assert isinstance(valid, GPTDataset) and len(valid.documents) == len(IndexedDataset(prefixes[0]))


def test_mock_data_is_deterministic_and_in_vocab():
    config = DataConfig(mock_data=True)
    train, valid, test = build_train_valid_test_datasets(config, 256, (10, 4, 0), 1, 7, vocab_size=50)
    again, _, _ = build_train_valid_test_datasets(config, 256, (10, 4, 0), 1, 7, vocab_size=50)
    assert test is None and len(train) >= 10 and len(valid) >= 4
    for i in range(10):
        item = train[i]
        np.testing.assert_array_equal(item["tokens"], again[i]["tokens"])
        assert item["tokens"].min() >= 0 and item["tokens"].max() < 50
    sequences = MockSequences(eod=7, vocab_size=50)
    for i in (0, 1, 99_999):
        tokens = sequences.get(i)
        assert len(tokens) == sequences.sequence_lengths[i] and tokens[-1] == 7 and (tokens[:-1] != 7).all()
        np.testing.assert_array_equal(sequences.get(i, 1, 3), tokens[1:4])


def test_blend_and_split_parsing():
    assert parse_blend(["a"]) == parse_blend(["a"])
    assert parse_blend(["a", "b"]).weights is None
    blend = parse_blend(["0.3 a 0.7", "b"])
    assert blend.prefixes == ["a", "b"] and blend.weights == [0.3, 0.7]
    assert parse_split("969, 30, 1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_matrix([0.9, 0.1, 0.0]) == [(0.0, 0.9), (0.9, 1.0), None]


@pytest.mark.parametrize(
    "tokens, message",
    [
        (["0.3", "a", "b", "c"], "'b' at position 3"),
        (["0.3", "a", "0.7"], "'0.3' looks like a weight"),
        (["-1", "a"], "negative"),
        (["0", "a", "0", "b"], "sum to 0"),
        ([], "empty"),
    ],
)
def test_bad_blend_names_the_token(tokens, message):
    with pytest.raises(ValueError, match=message):
        parse_blend(tokens)


def test_config_errors(corpus, tmp_path):
    with pytest.raises(ValueError, match="'x' is not a non-negative number"):
        parse_split("90,x,1")
    with pytest.raises(ValueError, match="cannot be combined"):
        DataConfig(data_path=["a"], train_data_path=["b"])
    with pytest.raises(ValueError, match="no data"):
        build_train_valid_test_datasets(DataConfig(), 16, (1, 1, 1), 1, EOD)
    with pytest.raises(Exception, match="missing.idx"):
        build_train_valid_test_datasets(
            DataConfig(data_path=[str(tmp_path / "missing")]), 16, (1, 1, 1), 1, EOD
        )
    prefix = corpus
    with pytest.raises(ValueError, match="leaves the valid split no sequences"):
        build_train_valid_test_datasets(DataConfig(data_path=[prefix], split="999,1"), 16, (1, 1, 1), 1, EOD)


class TinyDataset:
    """Stands in for a GPTDataset holding `size` samples."""

    def __init__(self, size, name):
        self.size, self.dataset_path = size, name
        self.unique_description = f'{{"name": "{name}"}}'

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return {"tokens": np.array([i])}


def test_blend_asking_too_much_of_a_dataset_names_it():
    with pytest.raises(ValueError, match="small.*draws 50 samples from it but it has 10"):
        BlendedDataset([TinyDataset(100, "big"), TinyDataset(10, "small")], [1, 1], 100, cache_dir=None)
    blend = BlendedDataset([TinyDataset(100, "big"), TinyDataset(10, "small")], [9, 1], 100, cache_dir=None)
    assert [blend[i]["tokens"][0] for i in range(12)] == list(reference_blend([9, 1], 12)[1])
    with pytest.raises(IndexError):
        blend[100]
