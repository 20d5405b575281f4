"""Streaming document readers (JSON Lines, Parquet, one-file-one-document text; local or any fsspec URL) and a
Parquet shard writer.

Every stage reads documents through `iter_records` (a whole file, or one `Span` of it: the unit of work a
parallel reader gets) so that bad input is reported the same way everywhere: the file and line of the record
and what to do about it, or a count in the stage's manifest when the user asked to skip bad records.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from storage.atomic import atomic_path
from storage.warc import is_warc

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSION_SUFFIXES = (".gz", ".zst", ".xz", ".bz2")
TEXT_SUFFIXES = (".py", ".txt", ".md")  # one file, one document (source code, plain text, Markdown)
MAX_TEXT_FILE_BYTES = 64 << 20  # a bigger "document" is a data dump, not a file to read whole into memory
PARQUET_BATCH_ROWS = 1024
READ_BUFFER_BYTES = 1 << 20
MAX_RECORD_BYTES = (
    64 << 20
)  # a record of the JSON Lines files tasks read (SFT conversations, QA): megabytes at most


@dataclass(frozen=True)
class Record:
    """One document as read: where it came from (for error messages) and its fields."""

    source: str
    line: int  # 1-based line (JSON Lines) or row number (Parquet)
    data: dict


@dataclass(frozen=True)
class Span:
    """A part of one document file, [start, stop) in the unit its format allows: bytes of plain JSON Lines (cut
    at line starts), lines of compressed JSON Lines (a stream cannot seek), row groups of Parquet."""

    start: int
    stop: int
    first_line: int  # 1-based line (JSON Lines) or row (Parquet) of the span's first record
    lines: int  # lines or rows in the span, blank lines included


class BadRecordError(ValueError):
    """A record that is not a JSON object with string text fields."""

    def __init__(self, source: str, line: int, problem: str):
        super().__init__(
            f"{source}:{line}: {problem}; to skip such records and count them, pass --skip-bad-records "
            "(in the corpus flow: --download.skip-bad-records true)"
        )
        self.source = source
        self.line = line
        self.problem = problem

    def __reduce__(self):  # raised in worker processes: rebuild it from its parts, not from its message
        return BadRecordError, (self.source, self.line, self.problem)


def document_format(url: str) -> str:
    """'jsonl' (optionally compressed), 'parquet' (compressed inside, by column) or 'text' (one file, one
    document), from the file name (of a chained URL, tar://a.py::code.tar.xz, the inner one)."""
    name = url.partition("::")[0].lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    for suffix in COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise ValueError(
        f"{url}: unknown document format; expected JSON Lines ({', '.join(JSONL_SUFFIXES)}, optionally "
        f"{', '.join(COMPRESSION_SUFFIXES)}), Parquet ({', '.join(PARQUET_SUFFIXES)}) or text files, one "
        f"document each ({', '.join(TEXT_SUFFIXES)})"
    )


def _is_document_file(path: str) -> bool:
    if is_warc(path):
        return True
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
            f"no input files match {pattern!r}; pass a file, a directory of .jsonl/.parquet/.warc.gz (or "
            ".py/.txt/.md, one document each) files, a glob such as 'data/*.jsonl.gz' or 'crawl/*.warc.gz', or "
            "an fsspec URL such as 's3://bucket/prefix/*.parquet' or 'tar://**/*.py::code.tar.xz'"
        )
    if "://" not in pattern:
        return sorted(paths)
    chained = pattern.partition("::")[2]  # the outer file of tar://...::archive.tar.xz, kept for reopening
    return sorted(fs.unstrip_protocol(p) + (f"::{chained}" if chained else "") for p in paths)


def is_compressed(url: str) -> bool:
    return fsspec.utils.infer_compression(url) is not None


def _check(obj, text_keys: Sequence[str], key_flag: str, sentence_lists: bool) -> str | None:
    """What is wrong with a parsed record, or None."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    for key in text_keys:
        if key not in obj:
            return f"no {key!r} field (fields: {', '.join(sorted(obj)) or 'none'}); set {key_flag}"
        value = obj[key]
        if isinstance(value, str) or (
            sentence_lists and isinstance(value, list) and all(isinstance(s, str) for s in value)
        ):
            continue
        kind = "null" if value is None else type(value).__name__
        return f"field {key!r} is {kind}, not a string" + (" or a list of strings" if sentence_lists else "")
    return None


def read_json_records(url: str, max_line_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple[int, str, object]]:
    """(line number, "file:line", parsed value) of every non-blank line of a JSON Lines file; a line that is not JSON,
    or longer than `max_line_bytes` (refused before it is read whole), is an error naming the file and the line."""
    for line, raw in read_lines(url, max_line_bytes=max_line_bytes):
        if not raw.strip():
            continue
        where = f"{url}:{line}"
        try:
            yield line, where, json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg}; column {error.colno})") from None


def read_lines(
    url: str, span: Span | None = None, max_line_bytes: int | None = None, **storage_options
) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line without its newline) of a JSON Lines file, or of one span of it, read in blocks; with
    `max_line_bytes`, a longer line is an error naming the file and the line as soon as that much of it is read."""
    limit = math.inf if max_line_bytes is None else max_line_bytes
    with fsspec.open(url, "rb", compression="infer", **storage_options) as f:
        line_no, stop, data = 1, None, b""
        if span is not None:
            line_no, stop = span.first_line, span.first_line + span.lines
            if is_compressed(url):
                data = _skip_lines(f, span.start, url)
            else:
                f.seek(span.start)
        middle: list[
            bytes
        ] = []  # blocks inside one long line, joined once its end comes (not copied per block)
        while stop is None or line_no < stop:
            block = f.read(READ_BUFFER_BYTES)
            if block and b"\n" not in block:
                middle.append(block)
                if len(data) + sum(map(len, middle)) > limit:
                    raise _line_too_long(url, line_no, max_line_bytes)
                continue
            data, middle = data + b"".join(middle), []
            lines = (data + block).split(b"\n")
            data = lines.pop()
            for number, line in enumerate([*lines, data], start=line_no):
                if len(line) > limit:
                    raise _line_too_long(url, number, max_line_bytes)
            if not block and data:  # end of file: what is left is the last line, which has no newline
                lines.append(data)
                data = b""
            elif not block and not lines:
                if stop is None:
                    return
                raise RuntimeError(f"{url}: file ended early; it changed while being read, rerun")
            for raw in lines if stop is None else lines[: stop - line_no]:
                yield line_no, raw
                line_no += 1


def _line_too_long(url: str, line: int, limit: int | None) -> ValueError:
    return ValueError(
        f"{url}:{line}: a line of over {limit} bytes, more than a record of this file may hold; it is not JSON Lines "
        "(one record per line), or a record is damaged"
    )


def _skip_lines(f, count: int, url: str) -> bytes:
    """Read past the first `count` lines of a stream; return what was read after them."""
    while count:
        block = f.read(READ_BUFFER_BYTES)
        if not block:
            raise RuntimeError(f"{url}: file ended early; it changed while being read, rerun")
        newlines = block.count(b"\n")
        if newlines < count:
            count -= newlines
            continue
        position = -1
        for _ in range(count):
            position = block.index(b"\n", position + 1)
        return block[position + 1 :]
    return b""


def _iter_jsonl(
    url: str, span: Span | None, stats: dict, **storage_options
) -> Iterator[tuple[int, object, str | None]]:
    """(line number, parsed object or None, parse problem or None) for each non-blank line."""
    for line_no, raw in read_lines(url, span, **storage_options):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace")
            stats["invalid_utf8_lines"] += 1
        if not text.strip():
            continue
        try:
            yield line_no, json.loads(text), None
        except json.JSONDecodeError as err:
            yield line_no, None, f"not valid JSON ({err.msg}; column {err.colno})"


def _iter_text(url: str, text_key: str, **storage_options) -> Iterator[tuple[int, object, str | None]]:
    """The whole file as one record {text_key: its text} (record number 1), or the problem that stops it."""
    with fsspec.open(url, "rb", **storage_options) as f:
        raw = f.read(MAX_TEXT_FILE_BYTES + 1)
    if len(raw) > MAX_TEXT_FILE_BYTES:
        yield 1, None, f"a text file over {MAX_TEXT_FILE_BYTES >> 20} MiB is not read as one document"
        return
    try:
        yield 1, {text_key: raw.decode("utf-8")}, None
    except UnicodeDecodeError as error:
        yield 1, None, f"not UTF-8 text (byte {error.start}: {raw[error.start : error.start + 1]!r})"


def _iter_parquet(
    url: str, span: Span | None, columns: Sequence[str] | None, key_flag: str, **storage_options
) -> Iterator[tuple[int, object, str | None]]:
    with fsspec.open(url, "rb", **storage_options) as f:
        parquet = pq.ParquetFile(f)
        names = parquet.schema_arrow.names
        missing = [name for name in columns or () if name not in names]
        if missing:
            raise ValueError(f"{url}: no column {missing[0]!r} (columns: {', '.join(names)}); set {key_flag}")
        row_groups = range(span.start, span.stop) if span is not None else None
        batches = parquet.iter_batches(
            batch_size=PARQUET_BATCH_ROWS,
            row_groups=row_groups,
            columns=list(columns) if columns is not None else None,
        )
        row = span.first_line if span is not None else 1
        for batch in batches:
            for obj in batch.to_pylist():
                yield row, obj, None
                row += 1


def iter_records(
    url: str,
    *,
    text_keys: Sequence[str] = ("text",),
    key_flag: str = "--text-key",
    sentence_lists: bool = False,
    skip_bad_records: bool = False,
    stats: dict | None = None,
    span: Span | None = None,
    columns: Sequence[str] | None = None,
    **storage_options,
) -> Iterator[Record]:
    """Stream the documents of one file (or one `span` of it) in bounded memory; bad records raise or are counted.

    A text file (`TEXT_SUFFIXES`) is one record, {text_keys[0]: the file's text}, record number 1.
    Every record must be an object whose `text_keys` are strings (or, with `sentence_lists`, lists of strings:
    a document's sentences); `key_flag` is the option the user sets to name other keys. Parquet files are read
    in their `columns` only (all when None); a missing column is an error naming the file. `stats` (when given)
    gets `skipped_bad_records` and `invalid_utf8_lines` added to its counts.
    """
    stats = {} if stats is None else stats
    stats.setdefault("skipped_bad_records", 0)
    stats.setdefault("invalid_utf8_lines", 0)
    kind = document_format(url)
    if kind == "jsonl":
        rows = _iter_jsonl(url, span, stats, **storage_options)
    elif kind == "text":
        rows = _iter_text(url, text_keys[0], **storage_options)
    else:
        rows = _iter_parquet(url, span, columns, key_flag, **storage_options)
    for line, obj, problem in rows:
        problem = problem or _check(obj, text_keys, key_flag, sentence_lists)
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
    with atomic_path(local_path) as tmp_path:
        pq.write_table(table, tmp_path, compression="zstd")


def read_parquet_columns(url: str, columns: list[str] | None = None, **storage_options) -> pa.Table:
    """A whole (small) Parquet shard, or some of its columns."""
    with fsspec.open(url, "rb", **storage_options) as f:
        return pq.read_table(f, columns=columns)
