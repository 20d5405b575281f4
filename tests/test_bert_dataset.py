"""BERTDataset and the shared masked-dataset machinery against line-by-line ports of Megatron-Core's code."""

from __future__ import annotations

import decimal
import glob
import logging
import pickle

import numpy as np
import pytest
import torch

from megatron_train.data.bert_dataset import BERTDataset, BERTDatasetConfig
from megatron_train.data.blended import BlendedDataset
from megatron_train.data.builder import build_masked_train_valid_test_datasets
from megatron_train.data.config import DataConfig
from megatron_train.data.masked_dataset import (
    LONG_SENTENCE_LENGTH,
    MT19937Stream,
    build_sentence_sample_index,
    continuation_ids,
    mt19937_64,
    ngram_masking,
)
from megatron_train.data.samplers import build_pretraining_data_loader
from megatron_train.tokenizer.null import NullTokenizer
from tests.helpers.wordpiece_corpus import build_tokenizer, write_sentence_corpus

NUM_STATISTICS_SAMPLES = 10_000

# ---------------------------------------------------------------- brute-force references (pure Python)


def reference_build_mapping(
    docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed, min_num_sent
):
    """helpers.cpp `build_mapping_impl`, line by line (the random engines are checked on their own)."""
    # C++ `round` takes halves away from zero.
    ratio = decimal.Decimal(1.0 / short_seq_prob) if short_seq_prob > 0 else decimal.Decimal(0)
    short_seq_ratio = int(ratio.quantize(decimal.Decimal(1), rounding=decimal.ROUND_HALF_UP))
    rand32 = MT19937Stream(seed)

    def target_len():
        if short_seq_ratio == 0:
            return max_seq_length
        r = rand32()
        return 2 + r % (max_seq_length - 1) if r % short_seq_ratio == 0 else max_seq_length

    maps = []
    for _ in range(num_epochs):
        if len(maps) >= max_num_samples:
            break
        for doc in range(len(docs) - 1):
            first, last = int(docs[doc]), int(docs[doc + 1])
            prev_start, num_remain = first, last - first
            long_sentence = num_remain > 1 and any(
                sizes[s] > LONG_SENTENCE_LENGTH for s in range(first, last)
            )
            if num_remain >= min_num_sent and not long_sentence:
                seq_len = num_sent = 0
                target = target_len()
                for s in range(first, last):
                    seq_len += int(sizes[s])
                    num_sent += 1
                    num_remain -= 1
                    if (seq_len >= target and num_remain > 1 and num_sent >= min_num_sent) or num_remain == 0:
                        maps.append([prev_start, s + 1, target])
                        prev_start = s + 1
                        target = target_len()
                        seq_len = num_sent = 0
    maps = np.array(maps, dtype=np.uint32)
    draws = mt19937_64(seed + 1, len(maps))
    for k, i in enumerate(range(len(maps) - 1, 0, -1)):
        j = int(draws[k]) % (i + 1)
        maps[[i, j]] = maps[[j, i]]
    return maps


def reference_masked_lm_predictions(
    token_ids, target_sequence_length, rng, tokenizer, config, get_token_mask
):
    """masked_dataset.py `_create_masked_lm_predictions` as Megatron writes it (no permutation/geometric)."""
    boundaries, candidates = [], []
    for i, token_id in enumerate(token_ids):
        if token_id == tokenizer.cls or token_id == tokenizer.sep:
            boundaries.append(1)
        elif not tokenizer.inv_vocab[token_id].startswith("##"):
            boundaries.append(1)
            candidates.append([i])
        else:
            boundaries.append(0)
            if config.masking_do_full_word and len(candidates) > 0:
                candidates[-1].append(i)
            else:
                candidates.append([i])
    n_maskings = min(
        config.masking_probability * target_sequence_length,
        max(1, int(round(len(token_ids) * config.masking_probability))),
    )
    ngram_nvals = np.arange(config.masking_max_ngram, dtype=np.int64) + 1
    nprobs = 1.0 / ngram_nvals
    nprobs = nprobs / nprobs.sum(keepdims=True)
    candidate_ngrams = [[candidates[idx : idx + n] for n in ngram_nvals] for idx in range(len(candidates))]
    rng.shuffle(candidate_ngrams)
    masked_token_ids = list(token_ids)
    masked_positions_and_labels = []
    masked_indices = set()
    for candidate_idx in range(len(candidate_ngrams)):
        n_ngrams = len(candidate_ngrams[candidate_idx])
        if len(masked_positions_and_labels) >= n_maskings:
            break
        if not candidate_ngrams[candidate_idx]:
            continue
        p = nprobs[:n_ngrams] / nprobs[:n_ngrams].sum(keepdims=True)
        n = rng.choice(ngram_nvals[:n_ngrams], p=p)
        while True:
            ngram_indices = sum(candidate_ngrams[candidate_idx][n - 1], [])
            n = n - 1
            if n_maskings >= len(masked_positions_and_labels) + len(ngram_indices):
                skip_candidate = False
                break
            if n == 0:
                skip_candidate = True
                break
        if skip_candidate:
            continue
        if any(idx in masked_indices for idx in ngram_indices):
            continue
        for index in ngram_indices:
            masked_indices.add(index)
            mask = get_token_mask(rng)
            masked_token_ids[index] = token_ids[index] if mask is None else mask
            masked_positions_and_labels.append((index, token_ids[index]))
    masked_positions_and_labels = sorted(masked_positions_and_labels, key=lambda x: x[0])
    return (
        masked_token_ids,
        [position for position, _ in masked_positions_and_labels],
        [label for _, label in masked_positions_and_labels],
    )


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer):
    """(prefix, documents): 400 documents of 1 to 8 sentences."""
    prefix = str(tmp_path_factory.mktemp("bert-corpus") / "corpus_text_sentence")
    return prefix, write_sentence_corpus(prefix, tokenizer, 400)


def bert_datasets(corpus, tokenizer, tmp_path, num_samples=(200, 20, 0), split="90,10,0", **config):
    data_config = DataConfig(data_path=[corpus[0]], split=split, data_cache_path=str(tmp_path / "cache"))
    config = BERTDatasetConfig(**{"seq_length": 64, "seed": 1234, "tokenizer": tokenizer, **config})
    return build_masked_train_valid_test_datasets(data_config, config, num_samples)


@pytest.fixture(scope="module")
def statistics_samples(corpus, tokenizer, tmp_path_factory):
    """10k BERT samples of --seq-length 128 with their datasets."""
    train, _, _ = bert_datasets(
        corpus,
        tokenizer,
        tmp_path_factory.mktemp("stats"),
        (NUM_STATISTICS_SAMPLES, 0, 0),
        "1",
        seq_length=128,
    )
    return train, [train[i] for i in range(NUM_STATISTICS_SAMPLES)]


def unmasked_text(sample):
    """The sample's tokens before masking."""
    text = sample["text"].copy()
    masked = sample["loss_mask"] == 1
    text[masked] = sample["labels"][masked]
    return text[sample["padding_mask"] == 1]


def words_of(tokens: list[int]) -> str:
    """Tokens as " 12 7 " so that `str.find` matches whole token runs."""
    return f" {' '.join(map(str, tokens))} "


# ---------------------------------------------------------------- tests


def test_random_engines_match_the_cpp_standard():
    # [rand.predef]: the 10000th output of a default-constructed engine (seed 5489).
    stream = MT19937Stream(5489, block=333)
    assert [stream() for _ in range(10000)][-1] == 4123659995
    assert int(mt19937_64(5489, 10000)[-1]) == 9981545732273789042
    np.testing.assert_array_equal(mt19937_64(77, 700)[:5], mt19937_64(77, 5))


@pytest.mark.parametrize(
    "num_epochs, max_num_samples, max_seq_length, short_seq_prob, min_sentences",
    [
        (1, 2**32 - 1, 61, 0.1, 2),
        (10**6, 3000, 61, 0.1, 2),
        (10**6, 500, 30, 0.0, 1),
        (3, 10**9, 125, 0.5, 1),
        (1, 2**32 - 1, 61, 0.4, 2),  # 1 / 0.4 = 2.5: C++ rounds it to 3
    ],
)
def test_sample_index_equals_megatron_build_mapping(
    corpus, num_epochs, max_num_samples, max_seq_length, short_seq_prob, min_sentences
):
    from storage.indexed_dataset import IndexedDataset

    sequences = IndexedDataset(corpus[0])
    docs = sequences.document_indices[10:300]  # documents 10..298, as a split passes them
    sizes = np.array(sequences.sequence_lengths)
    sizes[int(docs[3])] = LONG_SENTENCE_LENGTH + 1  # a document with a long sentence is skipped
    args = (docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, 1234, min_sentences)
    ours = build_sentence_sample_index(*args)
    expected = reference_build_mapping(*args)
    assert ours.dtype == np.uint32
    np.testing.assert_array_equal(ours, expected)
    assert len(ours) >= min(max_num_samples, 1)
    assert not np.any((ours[:, 0] <= docs[3]) & (ours[:, 1] > docs[3]))


def test_sample_index_without_usable_documents_is_an_error(corpus):
    docs = np.array([0, 1, 2, 3])
    with pytest.raises(ValueError, match="no document has 2 or more sentences"):
        build_sentence_sample_index(docs, np.full(3, 10), 10**6, 100, 61, 0.1, 1, 2)


@pytest.mark.parametrize("full_word", [True, False])
def test_masking_equals_megatron(tokenizer, full_word):
    config = BERTDatasetConfig(seq_length=128, seed=1, tokenizer=tokenizer, masking_do_full_word=full_word)
    continuation = continuation_ids(tokenizer)
    words = np.random.default_rng(5)
    for seed in range(50):
        length = int(words.integers(3, 126))
        tokens = [tokenizer.cls, *words.integers(6, 146, size=length).tolist(), tokenizer.sep]

        def replacement(rng):
            return tokenizer.mask if rng.random() < 0.8 else (None if rng.random() < 0.5 else 7)

        ours = ngram_masking(tokens, 125, np.random.RandomState(seed), config, continuation, replacement)
        expected = reference_masked_lm_predictions(
            tokens, 125, np.random.RandomState(seed), tokenizer, config, replacement
        )
        assert ours == expected


def test_sample_layout(corpus, tokenizer, tmp_path):
    train, valid, test = bert_datasets(corpus, tokenizer, tmp_path)
    assert isinstance(train, BERTDataset) and len(train) >= 200 and len(valid) >= 20 and test is None
    assert train.documents[0] == 0 and train.documents[-1] == 359 and valid.documents[0] == 360
    for idx in range(len(train)):
        sample = train[idx]
        assert sorted(sample) == [
            "is_random",
            "labels",
            "loss_mask",
            "padding_mask",
            "text",
            "truncated",
            "types",
        ]
        length = int(sample["padding_mask"].sum())
        assert all(len(sample[key]) == 64 for key in ("text", "types", "labels", "padding_mask", "loss_mask"))
        np.testing.assert_array_equal(sample["padding_mask"], np.arange(64) < length)
        text = unmasked_text(sample)
        types = sample["types"][:length]
        separators = np.nonzero(text == tokenizer.sep)[0]
        assert text[0] == tokenizer.cls and len(separators) == 2 and separators[1] == length - 1
        np.testing.assert_array_equal(types, np.arange(length) > separators[0])
        assert not sample["types"][length:].any() and not sample["text"][length:].any()
        segment_a, segment_b = text[1 : separators[0]].tolist(), text[separators[0] + 1 : -1].tolist()
        assert segment_a and segment_b

        # A and B are runs of the sample's sentences; swapped (B first in the text) when is_random.
        sentences, target, _ = train.sample_sentences(idx)
        flat = words_of([token for sentence in sentences for token in sentence])
        first, second = (segment_b, segment_a) if sample["is_random"] else (segment_a, segment_b)
        assert 0 <= flat.find(words_of(first)) < flat.rfind(words_of(second))
        assert len(segment_a) + len(segment_b) <= target <= 61
        assert sample["truncated"] == int(sum(map(len, sentences)) > target)

        masked = sample["loss_mask"] == 1
        np.testing.assert_array_equal(sample["labels"] == -1, ~masked)
        assert not masked[separators].any() and not masked[0]


def test_no_binary_head_gives_single_segments(corpus, tokenizer, tmp_path):
    train, _, _ = bert_datasets(corpus, tokenizer, tmp_path, classification_head=False)
    for idx in range(len(train)):
        sample = train[idx]
        length = int(sample["padding_mask"].sum())
        text = unmasked_text(sample)
        assert sample["is_random"] == 0 and not sample["types"].any()
        assert list(np.nonzero(text == tokenizer.sep)[0]) == [length - 1]
    one_sentence_documents = sum(len(document) == 1 for document in corpus[1][:360])
    assert one_sentence_documents > 0  # usable without the binary head, skipped with it
    with_head, _, _ = bert_datasets(corpus, tokenizer, tmp_path, (None, 0, 0))
    without_head, _, _ = bert_datasets(corpus, tokenizer, tmp_path, (None, 0, 0), classification_head=False)
    assert len(without_head) > len(with_head)


def test_masking_statistics_over_10k_samples(statistics_samples):
    _, samples = statistics_samples
    tokens = sum(int(sample["padding_mask"].sum()) for sample in samples)
    masked = [sample["loss_mask"] == 1 for sample in samples]
    num_masked = sum(int(mask.sum()) for mask in masked)
    assert abs(num_masked / tokens - 0.15) < 0.01

    replaced_by_mask = kept = 0
    for sample, mask in zip(samples, masked, strict=True):
        replaced_by_mask += int((sample["text"][mask] == 4).sum())  # [MASK]
        kept += int((sample["text"][mask] == sample["labels"][mask]).sum())
    # 80% [MASK], 10% a random token (1 in 146 of which happens to be the original), 10% kept.
    assert abs(replaced_by_mask / num_masked - 0.8) < 0.01
    assert abs(kept / num_masked - (0.1 + 0.1 / 146)) < 0.01
    assert abs((num_masked - replaced_by_mask - kept) / num_masked - 0.1 * 145 / 146) < 0.01


def test_sentence_order_labels_are_balanced(statistics_samples):
    _, samples = statistics_samples
    assert abs(np.mean([sample["is_random"] for sample in samples]) - 0.5) < 0.02
    assert 0 < np.mean([sample["truncated"] for sample in samples]) < 1


def test_whole_word_masking_never_splits_a_word(statistics_samples, tokenizer):
    _, samples = statistics_samples
    continuation = np.array(sorted(continuation_ids(tokenizer)))
    multi_piece_words_masked = 0
    for sample in samples:
        text, masked = unmasked_text(sample), sample["loss_mask"] == 1
        # A word: a piece and the "##" pieces after it, [CLS] and [SEP] aside (Megatron's candidates).
        pieces = np.nonzero((text != tokenizer.cls) & (text != tokenizer.sep))[0]
        starts = np.nonzero(~np.isin(text[pieces], continuation))[0]
        starts = np.union1d(starts, [0])
        all_masked = np.minimum.reduceat(masked[pieces], starts)
        any_masked = np.maximum.reduceat(masked[pieces], starts)
        np.testing.assert_array_equal(all_masked, any_masked)
        multi_piece_words_masked += int((all_masked & (np.diff(starts, append=len(pieces)) > 1)).sum())
    assert multi_piece_words_masked > 1000


def test_token_masking_splits_words(corpus, tokenizer, tmp_path):
    train, _, _ = bert_datasets(corpus, tokenizer, tmp_path, masking_do_full_word=False)
    continuation = continuation_ids(tokenizer)
    split_words = 0
    for idx in range(len(train)):
        sample = train[idx]
        text, masked = unmasked_text(sample), sample["loss_mask"] == 1
        pairs = np.nonzero(np.isin(text[1:], list(continuation)))[0] + 1  # continuations, after a piece
        split_words += int((masked[pairs] != masked[pairs - 1]).sum())
    assert split_words > 0


def test_same_seed_same_samples_other_seed_differs(corpus, tokenizer, tmp_path):
    first, _, _ = bert_datasets(corpus, tokenizer, tmp_path / "a")
    again, _, _ = bert_datasets(corpus, tokenizer, tmp_path / "b")
    other, _, _ = bert_datasets(corpus, tokenizer, tmp_path / "c", seed=4321)
    for idx in (0, 7, 150):
        for key, value in first[idx].items():
            np.testing.assert_array_equal(value, again[idx][key])
    assert any(not np.array_equal(first[i]["text"], other[i]["text"]) for i in range(10))


def test_cached_sample_index_is_reused(corpus, tokenizer, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_train.data.indices"):
        first, _, _ = bert_datasets(corpus, tokenizer, tmp_path)
        assert "BERTDataset-train indices built" in caplog.text
        caplog.clear()
        second, _, _ = bert_datasets(corpus, tokenizer, tmp_path)
        assert "BERTDataset-train indices loaded from cache" in caplog.text and "built" not in caplog.text
    assert isinstance(second.sample_index, np.memmap)
    np.testing.assert_array_equal(first.sample_index, second.sample_index)
    assert len(glob.glob(str(tmp_path / "cache" / "*-BERTDataset-*-description.txt"))) == 2
    bert_datasets(corpus, tokenizer, tmp_path, seq_length=32)  # another length: new indices
    bert_datasets(corpus, tokenizer, tmp_path, masking_probability=0.2)  # masking only: same indices
    assert len(glob.glob(str(tmp_path / "cache" / "*-BERTDataset-*-description.txt"))) == 4


def test_blend_and_split(corpus, tokenizer, tmp_path):
    other = str(tmp_path / "other_text_sentence")
    write_sentence_corpus(other, tokenizer, 200, seed=1)
    data_config = DataConfig(
        data_path=["0.7", corpus[0], "0.3", other], split="8,2,0", data_cache_path=str(tmp_path / "cache")
    )
    config = BERTDatasetConfig(seq_length=64, seed=1234, tokenizer=tokenizer)
    train, valid, test = build_masked_train_valid_test_datasets(data_config, config, (300, 30, 0))
    assert isinstance(train, BlendedDataset) and len(train) == 300 and len(valid) == 30 and test is None
    assert np.bincount(train.dataset_index).tolist() == [210, 90]
    assert [dataset.documents[-1] for dataset in train.datasets] == [319, 159]
    assert [dataset.documents[0] for dataset in valid.datasets] == [320, 160]
    sample = train[299]
    assert sample["text"][0] == tokenizer.cls and sample["text"].shape == (64,)
    in_worker = pickle.loads(pickle.dumps(train))  # as DataLoader workers receive it
    for key, value in in_worker[299].items():
        np.testing.assert_array_equal(value, sample[key])


def test_bad_settings_are_named(corpus, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="--mask-prob"):
        BERTDatasetConfig(seq_length=64, seed=1, tokenizer=tokenizer, masking_probability=1.5)
    with pytest.raises(ValueError, match="--seq-length"):
        BERTDatasetConfig(seq_length=4, seed=1, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="use --tokenizer-type BertWordPieceLowerCase"):
        BERTDatasetConfig(seq_length=64, seed=1, tokenizer=NullTokenizer(100))
    with pytest.raises(ValueError, match="--mock-data"):
        build_masked_train_valid_test_datasets(
            DataConfig(mock_data=True),
            BERTDatasetConfig(seq_length=64, seed=1, tokenizer=tokenizer),
            (1, 1, 1),
        )
    with pytest.raises(ValueError, match="leaves the test split no documents"):
        bert_datasets(corpus, tokenizer, tmp_path, (10, 1, 1), split="97,3,0.01")


def test_data_loader_batches(corpus, tokenizer, tmp_path):
    train, _, _ = bert_datasets(corpus, tokenizer, tmp_path)
    batch = next(iter(build_pretraining_data_loader(train, 0, 4, 0, 1)))
    assert {key: tuple(value.shape) for key, value in batch.items()} == {
        "text": (4, 64),
        "types": (4, 64),
        "labels": (4, 64),
        "is_random": (4,),
        "padding_mask": (4, 64),
        "loss_mask": (4, 64),
        "truncated": (4,),
    }
    assert all(value.dtype == torch.int64 for value in batch.values())
    np.testing.assert_array_equal(batch["text"][2].numpy(), train[2]["text"])
