"""Streaming document readers (JSON Lines, Parquet; local or any fsspec URL) and a Parquet shard writer.

Every corpus stage reads documents through `iter_records` so that bad input is reported the same way
everywhere: the file and line of the record and what to do about it, or a count in the stage's manifest
when the user asked to skip bad records.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSION_SUFFIXES = (".gz", ".zst", ".xz", ".bz2")
PARQUET_BATCH_ROWS = 1024
READ_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class Record:
    """One document as read: where it came from (for error messages) and its fields."""

    source: str
    line: int  # 1-based line (JSON Lines) or row number (Parquet)
    data: dict


class BadRecordError(ValueError):
    """A record that is not a JSON object with a string text field."""

    def __init__(self, source: str, line: int, problem: str):
        super().__init__(
            f"{source}:{line}: {problem}; to skip such records and count them, pass --skip-bad-records "
            "(in the corpus flow: --download.skip-bad-records true)"
        )
        self.source = source
        self.line = line


def document_format(url: str) -> str:
    """'jsonl' (optionally compressed) or 'parquet' (compressed inside, by column), from the file name."""
    name = url.lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    for suffix in COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise ValueError(
        f"{url}: unknown document format; expected JSON Lines ({', '.join(JSONL_SUFFIXES)}, optionally "
        f"{', '.join(COMPRESSION_SUFFIXES)}) or Parquet ({', '.join(PARQUET_SUFFIXES)})"
    )


def _is_document_file(path: str) -> bool:
    try:
        document_format(path)
    except ValueError:
        return False
    return True


def expand_inputs(pattern: str, **storage_options) -> list[str]:
    """A file, a directory (its document files, recursively), a glob or an fsspec URL -> sorted URLs."""
    fs, path = fsspec.core.url_to_fs(pattern, **storage_options)
    if any(ch in path for ch in "*?["):
        paths = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):
        paths = [p for p in fs.find(path) if _is_document_file(p)]
    elif fs.exists(path):
        paths = [path]
    else:
        paths = []
    if not paths:
        raise FileNotFoundError(
            f"no input files match {pattern!r}; pass a file, a directory of .jsonl/.parquet files, "
            "a glob such as 'data/*.jsonl.gz', or an fsspec URL such as 's3://bucket/prefix/*.parquet'"
        )
    if "://" not in pattern:
        return sorted(paths)
    return sorted(fs.unstrip_protocol(p) for p in paths)


def _check(source: str, line: int, obj, text_key: str) -> str | None:
    """What is wrong with a parsed record, or None."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    if text_key not in obj:
        return f"no {text_key!r} field (fields: {', '.join(sorted(obj)) or 'none'}); set --text-key"
    if not isinstance(obj[text_key], str):
        return f"field {text_key!r} is {type(obj[text_key]).__name__}, not a string"
    return None


def _iter_jsonl(url: str, stats: dict, **storage_options) -> Iterator[tuple[int, object, str | None]]:
    """(line number, parsed object or None, parse problem or None) for each non-blank line."""
    with fsspec.open(url, "rb", compression="infer", **storage_options) as f:
        # zstandard's reader has no readline(); a buffer gives every codec line iteration.
        for line_no, raw in enumerate(io.BufferedReader(f, READ_BUFFER_BYTES), start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("utf-8", errors="replace")
                stats["invalid_utf8_lines"] = stats.get("invalid_utf8_lines", 0) + 1
            if not text.strip():
                continue
            try:
                yield line_no, json.loads(text), None
            except json.JSONDecodeError as err:
                yield line_no, None, f"not valid JSON ({err.msg}; column {err.colno})"


def _iter_parquet(url: str, **storage_options) -> Iterator[tuple[int, object, str | None]]:
    with fsspec.open(url, "rb", **storage_options) as f:
        row = 0
        for batch in pq.ParquetFile(f).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for obj in batch.to_pylist():
                row += 1
                yield row, obj, None


def iter_records(
    url: str,
    *,
    text_key: str = "text",
    skip_bad_records: bool = False,
    stats: dict | None = None,
    **storage_options,
) -> Iterator[Record]:
    """Stream the documents of one file in bounded memory; bad records raise or are counted in `stats`.

    `stats` (when given) gets `skipped_bad_records` and `invalid_utf8_lines` added to its counts.
    """
    stats = {} if stats is None else stats
    stats.setdefault("skipped_bad_records", 0)
    stats.setdefault("invalid_utf8_lines", 0)
    if document_format(url) == "jsonl":
        rows = _iter_jsonl(url, stats, **storage_options)
    else:
        rows = _iter_parquet(url, **storage_options)
    for line, obj, problem in rows:
        problem = problem or _check(url, line, obj, text_key)
        if problem is None:
            yield Record(url, line, obj)
        elif skip_bad_records:
            stats["skipped_bad_records"] += 1
        else:
            raise BadRecordError(url, line, problem)


def write_parquet_shard(rows: list[dict], local_path: str) -> None:
    """Write documents as one Parquet file: `id`, `text` first, then every metadata key in first-seen order.

    Written to a temporary name and renamed, so a reader never sees half a file.
    """
    columns: dict[str, list] = {"id": [], "text": []}
    for row in rows:
        for key in row:
            columns.setdefault(key, [])
    for key, values in columns.items():
        values.extend(row.get(key) for row in rows)
    arrays = {
        key: pa.array(values, type=pa.string() if key in ("id", "text") else None)
        for key, values in columns.items()
    }
    write_parquet_table(pa.table(arrays), local_path)


def write_parquet_table(table: pa.Table, local_path: str) -> None:
    """Write a table as one zstd Parquet file via a temporary name (same bytes for the same table)."""
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    tmp_path = f"{local_path}.tmp"
    pq.write_table(table, tmp_path, compression="zstd")
    os.replace(tmp_path, local_path)


def read_parquet_columns(url: str, columns: list[str] | None = None, **storage_options) -> pa.Table:
    """A whole (small) Parquet shard, or some of its columns."""
    with fsspec.open(url, "rb", **storage_options) as f:
        return pq.read_table(f, columns=columns)
