"""The Megatron mmap indexed dataset: exact bytes, round trips, merging and every way a file can be bad."""

from __future__ import annotations

import errno
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from storage.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    best_dtype,
    data_file_path,
    index_file_path,
)

DOCUMENTS = [  # each document is a list of sequences
    [[1, 2, 3], [4, 5]],
    [[6]],
    [[7, 8, 9, 10], [], [11]],
    [[65499, 0]],
]


def build(prefix: str, documents=DOCUMENTS, dtype=np.uint16) -> str:
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
    for document in documents:
        tokens = [t for sequence in document for t in sequence]
        builder.add_document(tokens, [len(sequence) for sequence in document])
    builder.finalize(index_file_path(prefix))
    return prefix


def read_bytes(prefix: str) -> tuple[bytes, bytes]:
    with open(data_file_path(prefix), "rb") as b, open(index_file_path(prefix), "rb") as i:
        return b.read(), i.read()


def test_dtype_codes_and_best_dtype_follow_megatron():
    assert {code: np.dtype(t).name for code, t in DTYPE_CODES.items()} == {
        1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16",
    }  # fmt: skip
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(None) == np.int32


def test_index_bytes_match_megatron_layout(tmp_path):
    prefix = build(str(tmp_path / "ds"))
    data, index = read_bytes(prefix)

    lengths = [3, 2, 1, 4, 0, 1, 2]
    pointers = [0, 6, 10, 12, 20, 20, 22]  # byte offsets, 2 bytes per uint16 token
    document_indices = [0, 2, 3, 6, 7]
    expected = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    expected += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(document_indices))
    expected += struct.pack(f"<{len(lengths)}i", *lengths)
    expected += struct.pack(f"<{len(pointers)}q", *pointers)
    expected += struct.pack(f"<{len(document_indices)}q", *document_indices)
    assert index == expected
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 65499, 0]
    assert data == struct.pack(f"<{len(tokens)}H", *tokens)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path, dtype):
    prefix = build(str(tmp_path / "ds"), dtype=dtype)
    ds = IndexedDataset(prefix)
    sequences = [s for document in DOCUMENTS for s in document]
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(sequences)
    for i, sequence in enumerate(sequences):
        assert ds[i].dtype == np.dtype(dtype)
        assert ds[i].tolist() == sequence
    assert ds[-1].tolist() == [65499, 0]
    assert ds.get(2, 0).tolist() == [6]
    assert ds.get(3, offset=1, length=2).tolist() == [8, 9]
    assert ds.get(3, offset=2).tolist() == [9, 10]
    assert ds.sequence_lengths.dtype == np.int32
    assert ds.sequence_pointers.dtype == np.int64
    assert ds.document_indices.dtype == np.int64
    assert ds.document_indices.tolist() == [0, 2, 3, 6, 7]
    assert ds.sequence_pointers.tolist() == [ds.dtype.itemsize * t for t in [0, 3, 5, 6, 10, 10, 11]]
    with pytest.raises(IndexError):
        ds[len(sequences)]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    assert pickle.loads(pickle.dumps(ds))[3].tolist() == [7, 8, 9, 10]


def test_add_item_end_document_equals_add_document_and_accepts_tensors(tmp_path):
    by_document = build(str(tmp_path / "a"))
    by_item = str(tmp_path / "b")
    builder = IndexedDatasetBuilder(data_file_path(by_item), dtype=np.uint16)
    for document in DOCUMENTS:
        for sequence in document:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(index_file_path(by_item))
    assert read_bytes(by_item) == read_bytes(by_document)


def test_multi_sequence_documents_are_sliced_by_document_indices(tmp_path):
    ds = IndexedDataset(build(str(tmp_path / "ds")))
    documents = [
        [ds[s].tolist() for s in range(ds.document_indices[d], ds.document_indices[d + 1])]
        for d in range(len(ds.document_indices) - 1)
    ]
    assert documents == DOCUMENTS


@pytest.mark.parametrize("copy", ["kernel", "streamed"])
def test_add_index_merge_is_byte_identical_to_one_build(tmp_path, monkeypatch, copy):
    """The parts' `.bin` files are appended by the kernel (copy_file_range), or streamed where it refuses."""
    kernel_copied: list[int] = []
    real_copy = os.copy_file_range

    def copy_file_range(source: int, dest: int, count: int) -> int:
        if copy == "streamed":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        kernel_copied.append(real_copy(source, dest, count))
        return kernel_copied[-1]

    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    whole = build(str(tmp_path / "whole"))
    parts = [
        build(str(tmp_path / f"part{i}"), DOCUMENTS[a:b]) for i, (a, b) in enumerate([(0, 1), (1, 1), (1, 4)])
    ]
    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(data_file_path(merged), dtype=np.uint16)
    builder.add_document([42], [1])  # documents already in the builder shift the merged indices
    for part in parts:
        builder.add_index(part)
    builder.finalize(index_file_path(merged))

    expected = str(tmp_path / "expected")
    build(expected, [[[42]], *DOCUMENTS])
    assert read_bytes(merged) == read_bytes(expected)
    assert IndexedDataset(merged).document_indices.tolist() == [0, 1, 3, 4, 7, 8]
    assert read_bytes(whole)[0] == read_bytes(merged)[0][2:]
    assert sum(kernel_copied) == (len(read_bytes(whole)[0]) if copy == "kernel" else 0)


def test_empty_dataset_and_empty_documents(tmp_path):
    empty = build(str(tmp_path / "empty"), [])
    ds = IndexedDataset(empty)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]
    only_empty = build(str(tmp_path / "only_empty"), [[], [[]]])
    ds = IndexedDataset(only_empty)
    assert ds.document_indices.tolist() == [0, 0, 1]
    assert ds[0].tolist() == []


def test_builder_rejects_bad_input(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match="do not fit in uint16"):
        builder.add_item(np.array([70000], dtype=np.int64))
    with pytest.raises(IndexedDatasetError, match="lengths must partition"):
        builder.add_document([1, 2, 3], [2])
    with pytest.raises(IndexedDatasetError, match="no Megatron indexed-dataset code"):
        IndexedDatasetBuilder(str(tmp_path / "y.bin"), dtype=np.uint32)
    other = build(str(tmp_path / "int32"), dtype=np.int32)
    with pytest.raises(IndexedDatasetError, match="dtype int32 cannot be merged"):
        builder.add_index(other)


def corrupt_index(prefix: str, at: int, data: bytes) -> None:
    with open(index_file_path(prefix), "r+b") as f:
        f.seek(at)
        f.write(data)


def truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: corrupt_index(p, 0, b"NOTMMIDX!"), "bad magic"),
        (lambda p: corrupt_index(p, 9, struct.pack("<Q", 2)), "unsupported index version 2"),
        (lambda p: corrupt_index(p, 17, struct.pack("<B", 9)), "unknown dtype code 9"),
        (lambda p: truncate(index_file_path(p), 20), "shorter than the 34-byte header"),
        (lambda p: truncate(index_file_path(p), 34 + 10), "truncated index"),
        (lambda p: truncate(index_file_path(p), 34 + 7 * 12 + 5 * 8 + 3), "trailing bytes in index"),
        (lambda p: truncate(data_file_path(p), 20), "data file has 20 bytes but .* up to byte 26"),
        (lambda p: corrupt_index(p, 34 + 7 * 12 + 4 * 8, struct.pack("<q", 5)), "last document index 5"),
        (lambda p: corrupt_index(p, 34 + 7 * 12, struct.pack("<q", 1)), "must start with 0"),
        (lambda p: corrupt_index(p, 34, struct.pack("<i", -1)), "negative sequence length"),
        (lambda p: os.remove(data_file_path(p)), "file not found"),
    ],
    ids=[
        "magic",
        "version",
        "dtype",
        "header",
        "arrays",
        "trailing",
        "bin",
        "last-doc",
        "first-doc",
        "length",
        "missing",
    ],
)
def test_bad_files_raise_errors_naming_the_file(tmp_path, damage, message):
    prefix = build(str(tmp_path / "ds"))
    damage(prefix)
    with pytest.raises(IndexedDatasetError, match=message) as error:
        IndexedDataset(prefix)
    assert str(tmp_path / "ds") in str(error.value)


def test_exists(tmp_path):
    prefix = str(tmp_path / "ds")
    assert not IndexedDataset.exists(prefix)
    build(prefix)
    assert IndexedDataset.exists(prefix)
    os.remove(index_file_path(prefix))
    assert not IndexedDataset.exists(prefix)


def test_multimodal_index_exposes_sequence_modes(tmp_path):
    prefix = build(str(tmp_path / "ds"))
    assert IndexedDataset(prefix).sequence_modes is None
    with open(index_file_path(prefix), "ab") as f:
        f.write(bytes([0, 1, 0, 1, 0, 1, 1]))  # Megatron appends int8[sequence count] for multimodal data
    ds = IndexedDataset(prefix)
    assert ds.sequence_modes.tolist() == [0, 1, 0, 1, 0, 1, 1]
    assert ds[3].tolist() == [7, 8, 9, 10]
    with pytest.raises(IndexedDatasetError, match="multimodal datasets"):
        IndexedDatasetBuilder(str(tmp_path / "merged.bin"), dtype=np.uint16).add_index(prefix)
