"""Megatron-LM's mmap indexed dataset (`.bin` + `.idx`), byte for byte, in numpy only.

Files written here load in Megatron-LM's `megatron.core.datasets.indexed_dataset.IndexedDataset`
and the other way round. The `.idx` layout (little-endian):

    magic b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B
    sequence count S <Q | document index count D <Q
    sequence lengths int32[S] | sequence pointers (byte offsets into .bin) int64[S]
    document indices int64[D] | (multimodal only) sequence modes int8[S]

`document_indices` holds the sequence index where each document starts, plus a final entry equal
to S: it always starts with 0, so D is the number of documents + 1. The `.bin` is the tokens of all
sequences back to back in the dtype named by the code.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
from array import array
from collections.abc import Sequence
from typing import BinaryIO

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
# copy_file_range refusals that mean "copy the bytes yourself".
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document index count

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A `.bin`/`.idx` pair that cannot be read or written; the message names the file and the problem."""


def best_dtype(vocab_size: int | None) -> np.dtype:
    """Megatron's `DType.optimal_dtype`: uint16 when every token id fits below 65500, else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dtype_code(dtype) -> int:
    """The `.idx` code of a numpy dtype; raises IndexedDatasetError for dtypes Megatron cannot store."""
    try:
        return _CODE_OF_DTYPE[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise IndexedDatasetError(
            f"dtype {dtype!r} has no Megatron indexed-dataset code; use one of "
            f"{sorted(np.dtype(t).name for t in DTYPE_CODES.values())}"
        ) from None


def append_file(source_path: str, dest: BinaryIO) -> None:
    """Append the file's bytes to the open file `dest` with `os.copy_file_range`: the kernel copies (a reflink
    or a server-side copy where the file system has one), nothing passes through this process. Where the call
    is missing or refused (another file system, an old kernel) the bytes are streamed instead."""
    dest.flush()
    with open(source_path, "rb") as source:
        remaining = os.fstat(source.fileno()).st_size
        try:
            while remaining > 0:
                copied = os.copy_file_range(source.fileno(), dest.fileno(), remaining)
                if copied == 0:
                    raise OSError(errno.EIO, f"{source_path}: shorter than its size")
                remaining -= copied
        except (AttributeError, OSError) as error:
            if isinstance(error, OSError) and error.errno not in _NO_KERNEL_COPY:
                raise
            shutil.copyfileobj(source, dest, length=16 << 20)  # from where the kernel copy stopped


class IndexedDatasetBuilder:
    """Writes tokens to `bin_path` as they come; `finalize` writes the `.idx`.

    The index is kept in compact arrays (4 bytes per sequence, 8 per document) so that building a
    dataset of hundreds of millions of sequences stays within a few GB, like Megatron's builder.
    """

    def __init__(self, bin_path: str, dtype=np.int32) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._data_file = open(bin_path, "wb")  # noqa: SIM115 -- closed in finalize
        self._sequence_lengths = array("i")
        self._document_indices = array("q", [0])

    def _as_tokens(self, tokens) -> np.ndarray:
        """`tokens` (list, numpy array or CPU torch tensor) as a flat array of this builder's dtype."""
        values = np.asarray(tokens)
        if values.size == 0:
            return np.empty(0, dtype=self.dtype)
        if values.dtype != self.dtype and values.dtype.kind in "iub" and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            low, high = int(values.min()), int(values.max())
            if low < info.min or high > info.max:
                raise IndexedDatasetError(
                    f"{self.bin_path}: token ids in [{low}, {high}] do not fit in {self.dtype.name}; "
                    "build the dataset with a wider dtype (best_dtype(vocab_size))"
                )
        return values.astype(self.dtype, copy=False).reshape(-1)

    def add_item(self, tokens) -> None:
        """Append one sequence; call `end_document` after the last sequence of a document."""
        values = self._as_tokens(tokens)
        self._data_file.write(values.tobytes(order="C"))
        self._sequence_lengths.append(values.size)

    def end_document(self) -> None:
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(self, tokens, lengths: Sequence[int]) -> None:
        """Append one document made of `len(lengths)` sequences whose tokens are concatenated in `tokens`."""
        values = self._as_tokens(tokens)
        if sum(lengths) != values.size:
            raise IndexedDatasetError(
                f"{self.bin_path}: document of {values.size} tokens given sequence lengths summing to "
                f"{sum(lengths)}; the lengths must partition the tokens"
            )
        self._data_file.write(values.tobytes(order="C"))
        self._sequence_lengths.extend(lengths)
        self._document_indices.append(len(self._sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append a finished dataset: its documents follow ours; only its `.idx` is read here, its `.bin` is
        appended by the kernel (`append_file`), so merging the tokenize stage's per-shard partials moves no
        token through this process."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{index_file_path(path_prefix)}: dtype {other.dtype.name} cannot be merged into "
                f"{self.bin_path} of dtype {self.dtype.name}"
            )
        if other.sequence_modes is not None:
            raise IndexedDatasetError(
                f"{index_file_path(path_prefix)}: multimodal datasets (sequence modes) cannot be merged here"
            )
        offset = len(self._sequence_lengths)
        self._sequence_lengths.frombytes(other.sequence_lengths.astype("<i4").tobytes())
        self._document_indices.frombytes((other.document_indices[1:] + offset).astype("<i8").tobytes())
        del other
        append_file(data_file_path(path_prefix), self._data_file)

    def finalize(self, idx_path: str) -> None:
        """Close the `.bin` and write the `.idx` next to it."""
        self._data_file.close()
        lengths = np.frombuffer(self._sequence_lengths, dtype=np.int32)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(idx_path, "wb") as index_file:
            index_file.write(
                _HEADER.pack(
                    INDEX_MAGIC, INDEX_VERSION, self._code, lengths.size, len(self._document_indices)
                )
            )
            index_file.write(lengths.astype("<i4", copy=False).tobytes())
            index_file.write(pointers.astype("<i8", copy=False).tobytes())
            index_file.write(np.frombuffer(self._document_indices, dtype=np.int64).astype("<i8").tobytes())


class IndexedDataset:
    """Read-only view of `<path_prefix>.bin/.idx` through numpy memmaps; every field is checked on open.

    `dataset[i]` is the tokens of sequence i (a read-only array backed by the mmap);
    `get(i, offset, length)` a slice of it without reading the rest, as Megatron's GPTDataset uses it.
    """

    def __init__(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(
                    f"{path}: file not found (expected the pair {idx_path} + {bin_path})"
                )

        idx_size = os.path.getsize(idx_path)
        if idx_size < _HEADER.size:
            raise IndexedDatasetError(
                f"{idx_path}: truncated index, {idx_size} bytes is shorter than the {_HEADER.size}-byte header"
            )
        with open(idx_path, "rb") as index_file:
            magic, version, code, sequence_count, document_count = _HEADER.unpack(
                index_file.read(_HEADER.size)
            )
        if magic != INDEX_MAGIC:
            raise IndexedDatasetError(
                f"{idx_path}: bad magic {magic!r}, expected {INDEX_MAGIC!r}: not a Megatron mmap indexed dataset"
            )
        if version != INDEX_VERSION:
            raise IndexedDatasetError(
                f"{idx_path}: unsupported index version {version}, expected {INDEX_VERSION}"
            )
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(
                f"{idx_path}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])

        arrays_size = _HEADER.size + 12 * sequence_count + 8 * document_count
        if idx_size not in (arrays_size, arrays_size + sequence_count):
            problem = "truncated index" if idx_size < arrays_size else "trailing bytes in index"
            raise IndexedDatasetError(
                f"{idx_path}: {problem}: header says {sequence_count} sequences and {document_count} document "
                f"indices ({arrays_size} bytes) but the file has {idx_size} bytes; rebuild the dataset"
            )
        index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(index, dtype="<i4", count=sequence_count, offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, dtype="<i8", count=sequence_count, offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, dtype="<i8", count=document_count, offset=offset)
        offset += self.document_indices.nbytes
        self.sequence_modes = (
            np.frombuffer(index, dtype=np.int8, count=sequence_count, offset=offset)
            if idx_size > arrays_size
            else None
        )
        self._check_index(idx_path)

        bin_size = os.path.getsize(bin_path)
        needed = self._bytes_needed()
        if bin_size < needed:
            raise IndexedDatasetError(
                f"{bin_path}: data file has {bin_size} bytes but {idx_path} points up to byte {needed}; "
                "the .bin is truncated or belongs to another index"
            )
        # numpy cannot mmap an empty file: a dataset of empty sequences reads from an empty array.
        self._data = np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_size else np.empty(0, np.uint8)

    def _check_index(self, idx_path: str) -> None:
        documents = self.document_indices
        problem = None
        if documents.size == 0 or documents[0] != 0:
            problem = "document indices must start with 0"
        elif documents[-1] != self.sequence_lengths.size:
            problem = f"last document index {documents[-1]} != sequence count {self.sequence_lengths.size}"
        elif np.any(np.diff(documents) < 0):
            problem = "document indices decrease"
        elif np.any(self.sequence_lengths < 0):
            problem = "negative sequence length"
        elif np.any(self.sequence_pointers < 0):
            problem = "negative sequence pointer"
        if problem:
            raise IndexedDatasetError(f"{idx_path}: corrupt index: {problem}")

    def _bytes_needed(self) -> int:
        """The end of the furthest sequence in `.bin`, in bytes."""
        if self.sequence_lengths.size == 0:
            return 0
        ends = self.sequence_pointers + self.sequence_lengths.astype(np.int64) * self.dtype.itemsize
        return int(ends.max())

    def __len__(self) -> int:
        return self.sequence_lengths.size

    def all_tokens(self) -> np.ndarray:
        """Every token of the `.bin` up to the end of its furthest sequence, as one read-only array backed by the
        mmap (Megatron writes the sequences back to back): what a scan of the token ids reads."""
        return np.frombuffer(self._data, dtype=self.dtype, count=self._bytes_needed() // self.dtype.itemsize)

    def sequence_at(self, token: int) -> int:
        """The sequence holding the `token`-th token of `all_tokens()`."""
        return int(np.searchsorted(self.sequence_pointers, token * self.dtype.itemsize, side="right")) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset` to `offset + length` (default: to the end) of sequence `i`."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.path_prefix} with {n} sequences")
        i = int(i) % n
        sequence_length = int(self.sequence_lengths[i])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {i} of length {sequence_length}"
            )
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._data, dtype=self.dtype, count=length, offset=start)

    def __reduce__(self):
        """Pickle by path (DataLoader workers reopen the files) rather than copying the memmaps."""
        return (IndexedDataset, (self.path_prefix,))

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(data_file_path(path_prefix))
