"""GPT dataset references and data: brute-force ports of Megatron-Core's index-building algorithms (pure Python,
line by line) and random multi-sequence documents written as .bin/.idx (tests/test_gpt_dataset.py,
tests/test_samplers.py, benchmarks/dataset_index.py)."""

from __future__ import annotations

import math

import numpy as np

from storage.indexed_dataset import IndexedDatasetBuilder

EOD = 0


def reference_sample_index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch, drop_last, extra):
    """helpers.cpp `build_sample_idx`, line by line."""
    total = num_epochs * tokens_per_epoch - extra
    num_samples = total // seq_length if drop_last else math.ceil(total / seq_length)
    rows = [(0, 0)]
    doc, offset = 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + extra
        while remaining != 0:
            length = int(sizes[document_index[doc]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - extra
                remaining = 0
            else:
                if doc == len(document_index) - 1:
                    offset = int(sizes[document_index[doc]]) - extra
                    break
                doc += 1
                offset = 0
        rows.append((doc, offset))
    return np.array(rows)


def reference_indices(sizes, documents, num_samples, seq_length, seed, drop_last=True):
    """gpt_dataset.py `_build_document_sample_shuffle_indices`, with the original loops."""
    tokens_per_epoch = int(sum(int(sizes[d]) for d in documents))
    num_epochs, num_tokens = 1, tokens_per_epoch
    while num_samples is not None and num_tokens < num_samples * seq_length + 1:
        num_epochs += 1
        num_tokens += tokens_per_epoch
    separate = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = num_samples - sans_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)

    def document_index(epochs):
        index = np.mgrid[0:epochs, 0 : len(documents)][1]
        index[:] = documents
        index = index.reshape(-1).astype(np.int32)
        rng.shuffle(index)
        return index

    if separate:
        doc_index = np.concatenate((document_index(num_epochs - 1), document_index(1)))
    else:
        doc_index = document_index(num_epochs)
    sample_index = reference_sample_index(
        sizes, doc_index, seq_length, num_epochs, tokens_per_epoch, drop_last, 1
    )
    total = len(sample_index) - 1
    first = np.arange(sans_final if separate else total, dtype=np.uint32)
    rng.shuffle(first)
    last = np.arange(sans_final if separate else total, total, dtype=np.uint32)
    rng.shuffle(last)
    return doc_index, sample_index, np.concatenate((first, last)), separate


def reference_blend(weights, size):
    """helpers.cpp `build_blending_indices`, line by line."""
    weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    current = [0] * len(weights)
    dataset_index, dataset_sample_index = [], []
    for sample in range(size):
        sample_double = max(float(sample), 1.0)
        best, best_error = 0, weights[0] * sample_double - current[0]
        for i in range(1, len(weights)):
            error = weights[i] * sample_double - current[i]
            if error > best_error:
                best, best_error = i, error
        dataset_index.append(best)
        dataset_sample_index.append(current[best])
        current[best] += 1
    return np.array(dataset_index), np.array(dataset_sample_index)


def random_documents(rng, num_documents, max_sequences=3, max_length=40):
    """Documents of 1..max_sequences sequences of 1..max_length-1 ids in 1..99; eod closes each document."""
    documents = []
    for _ in range(num_documents):
        sequences = [
            list(rng.integers(1, 100, rng.integers(1, max_length)))
            for _ in range(rng.integers(1, max_sequences + 1))
        ]
        sequences[-1].append(EOD)
        documents.append(sequences)
    return documents


def write_dataset(prefix: str, documents: list[list[list[int]]]) -> str:
    """`documents` (each a list of sequences) as `prefix`.bin/.idx; returns `prefix`."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for sequences in documents:
        builder.add_document(np.concatenate(sequences), [len(s) for s in sequences])
    builder.finalize(prefix + ".idx")
    return prefix
