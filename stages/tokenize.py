"""The tokenize stage: Megatron-LM's `tools/preprocess_data.py` as a cached, resumable stage.

    python -m stages.tokenize --input 'data/*.jsonl.zst' --json-keys text --append-eod \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --output-prefix out/corpus --workers 8

writes `out/corpus_text_document.bin/.idx` (`_sentence` with `--split-sentences`), byte for byte what
Megatron writes for the same token ids, documents in input order. The artifact (under `--store`) holds the
same files as `tokens_<key>_<level>.bin/.idx`; a second run with the same input and settings is a cache hit.

How the work is cut: each input file is split into work units of at most `--shard-size-mb` and of about
1/max(`--partitions`, 8 x `--workers`) of the input, so the workers stay busy to the end: byte ranges of
plain JSON Lines at line boundaries (found in one streaming pass), line ranges of compressed JSON Lines
(at most `--workers` per file, since each worker decompresses its file from the top), groups of row
groups of Parquet. Worker processes read their unit, tokenize it in batches with the tokenizer's
`tokenize_batch` (Rust `encode_batch` for the Hugging Face-backed tokenizers, one thread per worker) and
write a partial `.bin/.idx`, which the parent commits as one shard of the artifact. At the end the
partials are merged in input order (`add_index`; Megatron's `--partitions` would interleave documents)
and removed. A killed run, rerun, redoes only the missing units and writes the same bytes. Memory is
bounded by the batch size and the longest document, never by the input size.

Input decisions, where Megatron crashes or is silent:
- a line that is not JSON, or lacks a `--json-keys` key, or whose value is neither a string nor a list of
  strings (a list is taken as the document's sentences, as in Megatron) stops the run with the file, line
  and problem; `--skip-bad-records` drops the record and counts it (`skipped_bad_records`).
- invalid UTF-8 is decoded with U+FFFD replacement characters and counted (`invalid_utf8_lines`);
  blank lines are skipped (Megatron would fail on them).
- an empty text (or one that tokenizes to nothing) is kept as a document of zero sequences, exactly as
  Megatron's `add_document([], [])` does, and counted (`empty_documents`); EOD is not appended to it.
- very long documents are tokenized whole (one sequence per document, or per sentence).

Sentence splitting (`--split-sentences`) is rule-based and downloads nothing (Megatron uses NLTK punkt):
- a sentence ends after `.`, `!`, `?` or `…` (a run of them, then any closing quotes or brackets) that is
  followed by whitespace and then an upper-case letter, a digit, an opening quote or bracket, or the end;
- except after a known abbreviation (Mr., Dr., Prof., St., vs., e.g., i.e., Fig., No., ...), a single-letter
  initial ("J. Smith") or a word with an inner period ("U.S.", "a.m."); decimals such as 3.14 never split
  because no whitespace follows the period;
- a blank line (paragraph break) always ends a sentence;
- without `--keep-newlines` each sentence is stripped of surrounding whitespace; with it, the whitespace
  and newlines after a sentence stay at its end, so the sentences concatenate back to the exact text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing
import os
import queue
import re
import shutil
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import ClassVar

import fsspec
import numpy as np
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem
from tqdm import tqdm

from megatron_train.tokenizer import TOKENIZER_TYPES, MegatronTokenizer, build_tokenizer
from storage.artifacts import (
    ArtifactRef,
    ArtifactStore,
    ArtifactWriter,
    run_stage,
    stage_key,
)
from storage.documents import BadRecordError, document_format, expand_inputs
from storage.fingerprint import canonical_json, hash_bytes, hash_file, source_fingerprint
from storage.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    data_file_path,
    index_file_path,
)

log = logging.getLogger("megatron_flow.stage.tokenize")

STAGE = "tokenize"
VERSION = "1"
ARTIFACT_PREFIX = "tokens"
PARTIALS_DIR = "partials"
MERGED_SHARD = "merged"
SUMMARY_FILE = "tokenize_summary.json"
READ_BLOCK_BYTES = 1 << 20
BATCH_DOCS = 512
BATCH_TEXT_BYTES = 4 << 20
UNITS_PER_WORKER = 8
# The summary's counters; sentences, tokens and empty_documents are summed over all --json-keys.
COUNTERS = (
    "documents",
    "sentences",
    "tokens",
    "bytes",
    "skipped_bad_records",
    "invalid_utf8_lines",
    "empty_documents",
)


class BadInputError(ValueError):
    """A bad record met in a worker process (BadRecordError's message; it survives pickling)."""


@dataclass(frozen=True)
class TokenizeParams:
    """The settings of `tools/preprocess_data.py` (same names) plus ours; see the module docstring.

    Only the fields that change the output (`OUTPUT_FIELDS`) and the tokenizer files' hashes enter the
    artifact's key: more workers or other partitions give the same bytes, hence the same artifact.
    """

    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    vocab_extra_ids: int = 0
    json_keys: tuple[str, ...] = ("text",)
    split_sentences: bool = False
    keep_newlines: bool = False
    append_eod: bool = False
    skip_bad_records: bool = False
    workers: int = max(1, os.cpu_count() or 1)
    partitions: int = 1
    shard_size_mb: float = 64.0
    log_interval: int = 1000

    OUTPUT_FIELDS: ClassVar[tuple[str, ...]] = (
        "tokenizer_type",
        "vocab_file",
        "merge_file",
        "tokenizer_model",
        "vocab_size",
        "vocab_extra_ids",
        "json_keys",
        "split_sentences",
        "keep_newlines",
        "append_eod",
    )

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_name(self, key: str) -> str:
        """Megatron's `<prefix>_<json-key>_<level>` with the artifact's prefix."""
        return f"{ARTIFACT_PREFIX}_{key}_{self.level}"

    def build_tokenizer(self) -> MegatronTokenizer:
        return build_tokenizer(
            self.tokenizer_type,
            vocab_file=self.vocab_file,
            merge_file=self.merge_file,
            tokenizer_model=self.tokenizer_model,
            vocab_size=self.vocab_size,
            vocab_extra_ids=self.vocab_extra_ids,
        )

    def fingerprint_fields(self) -> dict:
        """What the artifact's key depends on: output-changing settings, tokenizer files by content (not
        by path, so the same files elsewhere give the same key)."""
        fields = {name: getattr(self, name) for name in self.OUTPUT_FIELDS}
        for name in ("vocab_file", "merge_file", "tokenizer_model"):
            if fields[name] is not None:
                fields[name] = _path_hash(fields[name])
        return fields


def _path_hash(path: str) -> str:
    """Content hash of a tokenizer file or folder (its files, by name); a name that is no path stays a name."""
    if os.path.isfile(path):
        return hash_file(path)
    if os.path.isdir(path):
        names = sorted(
            os.path.relpath(os.path.join(root, name), path)
            for root, _, files in os.walk(path)
            for name in files
        )
        return hash_bytes(
            canonical_json({name: hash_file(os.path.join(path, name)) for name in names}).encode()
        )
    return path


# ---------------------------------------------------------------------------------------------------------
# Sentence splitting

# Words whose period does not end a sentence; not "etc.", which often does.
# fmt: off
ABBREVIATIONS = frozenset([
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "ft", "vs", "cf", "al", "fig", "figs",
    "no", "nos", "vol", "vols", "ch", "sec", "pp", "gen", "col", "lt", "sgt", "capt", "cmdr", "adm",
    "gov", "sen", "rep", "rev", "hon", "messrs", "mme", "mlle", "jan", "feb", "mar", "apr", "jun",
    "jul", "aug", "sep", "sept", "oct", "nov", "dec", "approx", "dept", "est", "inc", "ltd", "co",
    "corp", "univ",
])
# fmt: on
_CLOSERS = "\"'\u201d\u2019)]"
_SENTENCE_OPENERS = "\"'\u201c\u2018([{"
_SENTENCE_END = re.compile(r"[.!?\u2026]+[\"'\u201d\u2019)\]]*\s+|\n[ \t]*\n\s*")
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def _is_sentence_end(text: str, match: re.Match) -> bool:
    """Whether a run of sentence-final punctuation and whitespace really ends a sentence."""
    if _BLANK_LINE.search(match.group()):
        return True
    following = text[match.end() : match.end() + 1]
    if not (following.isupper() or following.isdigit() or following in _SENTENCE_OPENERS):
        return False
    if match.group().rstrip().rstrip(_CLOSERS) != ".":  # '!', '?', '...': no abbreviation to rule out
        return True
    words = text[max(0, match.start() - 40) : match.start()].split()
    word = words[-1].lstrip(_SENTENCE_OPENERS) if words and not text[match.start() - 1].isspace() else ""
    is_initial = len(word) == 1 and word.isalpha()
    return not (is_initial or "." in word or word.lower() in ABBREVIATIONS)


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """The sentences of `text` by the rules in the module docstring."""
    sentences = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        if match.end() < len(text) and text[start : match.end()].strip() and _is_sentence_end(text, match):
            sentences.append(text[start : match.end()])
            start = match.end()
    sentences.append(text[start:])
    if keep_newlines:
        return [s for s in sentences if s]
    return [s.strip() for s in sentences if s.strip()]


# ---------------------------------------------------------------------------------------------------------
# Work units


@dataclass(frozen=True)
class WorkUnit:
    """A slice of one input file, [start, stop) in its kind's unit: bytes of plain JSON Lines, lines of
    compressed JSON Lines (they cannot seek: a worker decompresses from the top), row groups of Parquet."""

    file_index: int
    url: str
    kind: str  # "jsonl", "compressed-jsonl" or "parquet"
    start: int
    stop: int
    first_line: int  # 1-based line (JSON Lines) or row (Parquet) of the unit's first record
    records: int  # lines or rows in the unit (for progress)

    @property
    def name(self) -> str:
        """Sorts in input order; names the range, so a different cut never reuses a stale shard."""
        return f"{self.file_index:05d}-{self.start:013d}-{self.stop:013d}"


def _plan_jsonl(file_index: int, url: str, unit_bytes: int, storage_options: dict) -> list[WorkUnit]:
    """Cut a plain JSON Lines file at the first line boundary after every `unit_bytes`."""
    units: list[WorkUnit] = []
    start, first_line, lines_before_block, position = 0, 1, 0, 0

    def cut(stop: int, lines_through: int) -> None:
        nonlocal start, first_line
        units.append(
            WorkUnit(file_index, url, "jsonl", start, stop, first_line, lines_through - first_line + 1)
        )
        start, first_line = stop, lines_through + 1

    ends_with_newline = True
    with fsspec.open(url, "rb", **storage_options) as f:
        while block := f.read(READ_BLOCK_BYTES):
            ends_with_newline = block.endswith(b"\n")
            newline = -1
            while True:
                newline = block.find(b"\n", max(start + unit_bytes - position - 1, newline + 1))
                if newline < 0:
                    break
                cut(position + newline + 1, lines_before_block + block.count(b"\n", 0, newline + 1))
            lines_before_block += block.count(b"\n")
            position += len(block)
    if position > start:
        cut(position, lines_before_block + (not ends_with_newline))
    return units


def _plan_compressed_jsonl(
    file_index: int, url: str, unit_bytes: int, max_units: int, storage_options: dict
) -> list[WorkUnit]:
    """Count a compressed file's lines, then cut it into at most `max_units` equal line ranges."""
    lines = size = 0
    last = b"\n"
    with fsspec.open(url, "rb", compression="infer", **storage_options) as f:
        while block := f.read(READ_BLOCK_BYTES):
            lines += block.count(b"\n")
            size += len(block)
            last = block[-1:]
    lines += last != b"\n"
    count = max(1, min(max_units, -(-size // unit_bytes), lines))
    bounds = [lines * i // count for i in range(count + 1)]
    return [
        WorkUnit(file_index, url, "compressed-jsonl", a, b, a + 1, b - a)
        for a, b in pairwise(bounds)
        if b > a
    ]


def _plan_parquet(file_index: int, url: str, unit_bytes: int, storage_options: dict) -> list[WorkUnit]:
    """Group consecutive row groups into units of about `unit_bytes` (uncompressed)."""
    with fsspec.open(url, "rb", **storage_options) as f:
        metadata = pq.ParquetFile(f).metadata
    units: list[WorkUnit] = []
    start, first_row, rows, size = 0, 1, 0, 0
    for group in range(metadata.num_row_groups):
        rows += metadata.row_group(group).num_rows
        size += metadata.row_group(group).total_byte_size
        if size >= unit_bytes or group == metadata.num_row_groups - 1:
            units.append(WorkUnit(file_index, url, "parquet", start, group + 1, first_row, rows))
            start, first_row, rows, size = group + 1, first_row + rows, 0, 0
    return units


def plan_units(urls: Sequence[str], params: TokenizeParams, storage_options: dict) -> list[WorkUnit]:
    """Every input file cut into units, in input order (deterministic: same files and settings, same cut)."""
    total = sum(fsspec.core.url_to_fs(url, **storage_options)[0].size(url) or 0 for url in urls)
    wanted_units = max(params.partitions, UNITS_PER_WORKER * params.workers)
    unit_bytes = max(1, min(int(params.shard_size_mb * 2**20), total // wanted_units))
    units: list[WorkUnit] = []
    for file_index, url in enumerate(urls):
        if document_format(url) == "parquet":
            units += _plan_parquet(file_index, url, unit_bytes, storage_options)
        elif _is_compressed(url):
            units += _plan_compressed_jsonl(file_index, url, unit_bytes, params.workers, storage_options)
        else:
            units += _plan_jsonl(file_index, url, unit_bytes, storage_options)
    return units


def _is_compressed(url: str) -> bool:
    return fsspec.utils.infer_compression(url) is not None


# ---------------------------------------------------------------------------------------------------------
# Worker side: read a unit, tokenize it in batches, write a partial indexed dataset per key

_worker: dict = {}


def _init_worker(params: TokenizeParams, storage_options: dict, progress, parent_pid: int) -> None:
    # One single-threaded tokenizer per process: `--workers` is the number of cores used.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(
        params=params,
        tokenizer=params.build_tokenizer(),
        storage_options=storage_options,
        progress=progress,
        parent_pid=parent_pid,
    )


def _jsonl_lines(unit: WorkUnit, storage_options: dict) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of the unit's lines, read in blocks."""
    with fsspec.open(unit.url, "rb", compression="infer", **storage_options) as f:
        if unit.kind == "jsonl":
            f.seek(unit.start)
            data = b""
        else:
            data = _skip_lines(f, unit.start, unit.url)
        line_no, stop = unit.first_line, unit.first_line + unit.records
        while line_no < stop:
            block = f.read(READ_BLOCK_BYTES)
            lines = (data + block).split(b"\n")
            data = lines.pop()
            if not block and data:  # end of file: what is left is the last line, which has no newline
                lines.append(data)
                data = b""
            elif not block and not lines:
                raise RuntimeError(f"{unit.url}: file ended early; it changed while being tokenized, rerun")
            for raw in lines[: stop - line_no]:
                yield line_no, raw
                line_no += 1


def _skip_lines(f, count: int, url: str) -> bytes:
    """Read past the first `count` lines of a stream; return what was read after them."""
    while count:
        block = f.read(READ_BLOCK_BYTES)
        if not block:
            raise RuntimeError(f"{url}: file ended early; it changed while being tokenized, rerun")
        newlines = block.count(b"\n")
        if newlines < count:
            count -= newlines
            continue
        position = -1
        for _ in range(count):
            position = block.index(b"\n", position + 1)
        return block[position + 1 :]
    return b""


def _document_fields(unit: WorkUnit, obj, keys: Sequence[str], line: int) -> list[str | list[str]]:
    """The values of `keys` in a record, or BadRecordError naming the file, line and problem."""
    if not isinstance(obj, dict):
        raise BadRecordError(unit.url, line, f"expected a JSON object, got {type(obj).__name__}")
    values = []
    for key in keys:
        if key not in obj:
            fields = ", ".join(sorted(obj)) or "none"
            raise BadRecordError(unit.url, line, f"no {key!r} field (fields: {fields}); set --json-keys")
        value = obj[key]
        if not (
            isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))
        ):
            kind = "null" if value is None else type(value).__name__
            raise BadRecordError(
                unit.url, line, f"field {key!r} is {kind}, not a string or a list of strings"
            )
        values.append(value)
    return values


def _parquet_records(unit: WorkUnit, keys: Sequence[str], storage_options: dict) -> Iterator[tuple]:
    """(row number, {key: value}, None) of the unit's row groups, reading only the `keys` columns."""
    with fsspec.open(unit.url, "rb", **storage_options) as f:
        parquet = pq.ParquetFile(f)
        columns = parquet.schema_arrow.names
        missing = [key for key in keys if key not in columns]
        if missing:
            raise BadInputError(
                f"{unit.url}: no column {missing[0]!r} (columns: {', '.join(columns)}); set --json-keys"
            )
        row_groups = list(range(unit.start, unit.stop))
        batches = parquet.iter_batches(batch_size=BATCH_DOCS, row_groups=row_groups, columns=list(keys))
        for row, obj in enumerate(
            (obj for batch in batches for obj in batch.to_pylist()), start=unit.first_line
        ):
            yield row, obj, None


def _jsonl_records(unit: WorkUnit, stats: dict, storage_options: dict) -> Iterator[tuple]:
    """(line number, parsed JSON or None for a blank line, problem or None) of the unit's lines.

    Invalid UTF-8 is replaced (U+FFFD) and counted."""
    for line, raw in _jsonl_lines(unit, storage_options):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace")
            stats["invalid_utf8_lines"] += 1
        if not text.strip():
            yield line, None, None
            continue
        try:
            yield line, json.loads(text), None
        except json.JSONDecodeError as err:
            yield line, None, f"not valid JSON ({err.msg}; column {err.colno})"


def _unit_documents(unit: WorkUnit, keys: Sequence[str], stats: dict) -> Iterator[list | None]:
    """The values of `keys` per record of the unit; None for a blank line or a skipped bad record."""
    storage_options, skip_bad = _worker["storage_options"], _worker["params"].skip_bad_records
    if unit.kind == "parquet":
        records = _parquet_records(unit, keys, storage_options)
    else:
        records = _jsonl_records(unit, stats, storage_options)
    for line, obj, problem in records:
        try:
            if problem is not None:
                raise BadRecordError(unit.url, line, problem)
            values = None if obj is None else _document_fields(unit, obj, keys, line)
        except BadRecordError:
            if not skip_bad:
                raise
            stats["skipped_bad_records"] += 1
            values = None
        yield values


def _encode_batch(
    documents: list[str | list[str]], dtype: np.dtype, stats: dict
) -> list[tuple[np.ndarray, list[int]]]:
    """Tokens and sequence lengths of each document, as Megatron's `Encoder.encode` makes them."""
    params, tokenizer = _worker["params"], _worker["tokenizer"]
    sentences_per_document = [
        document if isinstance(document, list)
        else split_sentences(document, params.keep_newlines) if params.split_sentences
        else [document]
        for document in documents
    ]  # fmt: skip
    flat = [sentence for sentences in sentences_per_document for sentence in sentences]
    ids = iter(tokenizer.tokenize_batch(flat) if flat else [])
    encoded = []
    for sentences in sentences_per_document:
        kept = [sentence_ids for sentence_ids in (next(ids) for _ in sentences) if sentence_ids]
        lengths = [len(sentence_ids) for sentence_ids in kept]
        if kept and params.append_eod:
            kept.append([tokenizer.eod])
            lengths[-1] += 1
        tokens = np.array(list(chain.from_iterable(kept)), dtype=dtype)
        encoded.append((tokens, lengths))
        stats["sentences"] += len(lengths)
        stats["tokens"] += tokens.size
        stats["empty_documents"] += not lengths
    return encoded


def _utf8_size(value: str | list[str]) -> int:
    return len(value.encode()) if isinstance(value, str) else sum(len(s.encode()) for s in value)


def _tokenize_unit(unit: WorkUnit, out_dir: str) -> tuple[WorkUnit, dict[str, str], dict]:
    """Tokenize one unit into partial `.bin/.idx` files under `out_dir`; return them and the unit's counts."""
    params, tokenizer = _worker["params"], _worker["tokenizer"]
    if params.append_eod and tokenizer.eod is None:
        raise ValueError(f"--append-eod: the {params.tokenizer_type} tokenizer has no end-of-document token")
    keys = params.json_keys
    stats = dict.fromkeys(COUNTERS, 0)
    dtype = best_dtype(tokenizer.vocab_size)
    # A unique suffix: a worker orphaned by a killed parent never writes the files a rerun commits.
    prefixes = {key: os.path.join(out_dir, f"{unit.name}.{uuid.uuid4().hex}.{key}") for key in keys}
    builders = {key: IndexedDatasetBuilder(data_file_path(prefixes[key]), dtype=dtype) for key in keys}
    batch: list[list] = []
    consumed = text_bytes = 0

    def flush() -> None:
        nonlocal consumed, text_bytes
        if _worker["parent_pid"] != os.getppid():
            raise SystemExit("parent process died")
        for k, key in enumerate(keys):
            for tokens, lengths in _encode_batch([document[k] for document in batch], dtype, stats):
                builders[key].add_document(tokens, lengths)
        _worker["progress"].put((consumed, len(batch), text_bytes))
        stats["documents"] += len(batch)
        stats["bytes"] += text_bytes
        batch.clear()
        consumed = text_bytes = 0

    try:
        for values in _unit_documents(unit, keys, stats):
            consumed += 1
            if values is None:
                continue
            batch.append(values)
            text_bytes += sum(_utf8_size(value) for value in values)
            if len(batch) >= BATCH_DOCS or text_bytes >= BATCH_TEXT_BYTES:
                flush()
    except BadRecordError as err:
        raise BadInputError(str(err)) from None
    flush()
    files = {}
    for key in keys:
        builders[key].finalize(index_file_path(prefixes[key]))
        name = params.output_name(key)
        files[f"{PARTIALS_DIR}/{unit.name}/{name}.bin"] = data_file_path(prefixes[key])
        files[f"{PARTIALS_DIR}/{unit.name}/{name}.idx"] = index_file_path(prefixes[key])
    return unit, files, stats


# ---------------------------------------------------------------------------------------------------------
# Parent side: plan, run the units in worker processes, commit them, merge


class _Progress:
    """A tqdm bar over input records, with docs/s and MB/s; Megatron-style log lines when not on a terminal."""

    def __init__(self, total: int, done: int, log_interval: int):
        self.bar = tqdm(
            total=total, initial=done, unit="rec", desc="tokenize", disable=None, dynamic_ncols=True
        )
        self.log_interval = max(1, log_interval)
        self.started = time.time()
        self.documents = self.bytes = 0

    def update(self, records: int, documents: int, text_bytes: int) -> None:
        before = self.documents
        self.documents += documents
        self.bytes += text_bytes
        elapsed = max(time.time() - self.started, 1e-9)
        docs_per_s, mb_per_s = self.documents / elapsed, self.bytes / elapsed / 2**20
        self.bar.update(records)
        self.bar.set_postfix_str(f"{docs_per_s:.0f} docs/s, {mb_per_s:.2f} MB/s", refresh=False)
        if self.bar.disable and self.documents // self.log_interval > before // self.log_interval:
            log.info("Processed %d documents (%.1f docs/s, %.2f MB/s).", self.documents, docs_per_s, mb_per_s)

    def close(self) -> None:
        self.bar.close()


def _partial_prefix(writer: ArtifactWriter, name: str) -> str:
    """A local path prefix of a committed partial `<name>.bin/.idx` (downloaded from a remote store)."""
    if isinstance(writer.fs, LocalFileSystem):
        return f"{writer.path}/{name}"
    local = os.path.join(writer.local_dir, "download", name)
    os.makedirs(os.path.dirname(local), exist_ok=True)
    for path in (data_file_path(name), index_file_path(name)):
        writer.fs.get_file(f"{writer.path}/{path}", os.path.join(writer.local_dir, "download", path))
    return local


def _read_json(writer: ArtifactWriter, name: str) -> dict:
    with writer.fs.open(f"{writer.path}/{name}", "rb") as f:
        return json.load(f)


def _tokenize_units(
    writer: ArtifactWriter, units: list[WorkUnit], params: TokenizeParams, storage_options: dict
) -> None:
    """Run the units not yet committed in worker processes; commit each as soon as it is done."""
    pending = [unit for unit in units if not writer.has_shard(unit.name)]
    if len(pending) < len(units):
        log.info("resuming: %d of %d units already committed", len(units) - len(pending), len(units))
    if not pending:
        return
    out_dir = os.path.join(writer.local_dir, PARTIALS_DIR)
    os.makedirs(out_dir, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    progress_queue = context.Queue()
    pending_names = {unit.name for unit in pending}
    done_records = sum(unit.records for unit in units if unit.name not in pending_names)
    progress = _Progress(sum(unit.records for unit in units), done_records, params.log_interval)
    pool = ProcessPoolExecutor(
        max_workers=min(params.workers, len(pending)),
        mp_context=context,
        initializer=_init_worker,
        initargs=(params, storage_options, progress_queue, os.getpid()),
    )
    try:
        running: set[Future] = {pool.submit(_tokenize_unit, unit, out_dir) for unit in pending}
        while running:
            done, running = wait(running, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(progress_queue, progress)
            for future in done:
                try:
                    unit, files, stats = future.result()
                except BrokenProcessPool:
                    params.build_tokenizer()  # a worker died starting up: raise the tokenizer's own error here
                    raise
                stats_path = os.path.join(out_dir, f"{unit.name}.{uuid.uuid4().hex}.stats.json")
                with open(stats_path, "w") as f:
                    json.dump(stats, f, sort_keys=True)
                writer.commit_shard(
                    unit.name, {**files, f"{PARTIALS_DIR}/{unit.name}/stats.json": stats_path}
                )
        _drain(progress_queue, progress)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        progress.close()


def _drain(progress_queue, progress: _Progress) -> None:
    while True:
        try:
            progress.update(*progress_queue.get_nowait())
        except queue.Empty:
            return


def _merge_units(writer: ArtifactWriter, units: list[WorkUnit], params: TokenizeParams) -> None:
    """Concatenate the partials in input order into the final files, commit them, then drop the partials."""
    summary: dict = dict.fromkeys(COUNTERS, 0)
    for unit in units:
        for counter, value in _read_json(writer, f"{PARTIALS_DIR}/{unit.name}/stats.json").items():
            summary[counter] += value
    files = {}
    merge_dir = os.path.join(writer.local_dir, "merged")
    os.makedirs(merge_dir, exist_ok=True)
    for key in params.json_keys:
        name = params.output_name(key)
        partials = [_partial_prefix(writer, f"{PARTIALS_DIR}/{unit.name}/{name}") for unit in units]
        # The workers chose the dtype from the vocabulary; with no input at all, the parent does.
        dtype = (
            IndexedDataset(partials[0]).dtype if units else best_dtype(params.build_tokenizer().vocab_size)
        )
        prefix = os.path.join(merge_dir, name)
        builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
        for partial in tqdm(partials, desc=f"merge {key}", unit="unit", disable=None):
            builder.add_index(partial)
        builder.finalize(index_file_path(prefix))
        files[f"{name}.bin"], files[f"{name}.idx"] = data_file_path(prefix), index_file_path(prefix)
    summary["dtype"] = dtype.name
    summary_path = os.path.join(merge_dir, SUMMARY_FILE)
    with open(summary_path, "w") as f:
        json.dump(summary, f, sort_keys=True)
    writer.commit_shard(MERGED_SHARD, {**files, SUMMARY_FILE: summary_path})
    if writer.fs.exists(f"{writer.path}/{PARTIALS_DIR}"):
        writer.fs.rm(f"{writer.path}/{PARTIALS_DIR}", recursive=True)


def _resolve_inputs(inputs) -> tuple[list[str], list[ArtifactRef | str], dict]:
    """(document file URLs, fingerprints for the key, storage options) of the stage's inputs."""
    items = [inputs] if isinstance(inputs, (str, ArtifactRef)) else list(inputs)
    urls: list[str] = []
    fingerprints: list[ArtifactRef | str] = []
    storage_options: dict = {}
    for item in items:
        if isinstance(item, ArtifactRef):
            shards = [name for name in item.files("shards/") if name.endswith(".parquet")]
            if not shards:
                raise ValueError(
                    f"{item.url}: artifact of stage {item.stage!r} has no shards/*.parquet documents"
                )
            urls.extend(item.file_url(name) for name in shards)
            storage_options = item.storage_options
            fingerprints.append(item)
        else:
            urls.extend(expand_inputs(item))
            fingerprints.append(source_fingerprint(item))
    return urls, fingerprints, storage_options


Params = TokenizeParams


def key(params: TokenizeParams, inputs) -> str:
    """The output's key, as `run` computes it."""
    fingerprints = _resolve_inputs(inputs)[1]
    return stage_key(STAGE, VERSION, params.fingerprint_fields(), fingerprints)


def run(params: TokenizeParams, inputs, store: ArtifactStore) -> ArtifactRef:
    """Tokenize documents (an artifact of Parquet shards, a file, glob or URL, or a list of them)."""
    if params.tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"unknown --tokenizer-type {params.tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
        )
    if not params.json_keys:
        raise ValueError("--json-keys names no key: give at least one, e.g. --json-keys text")
    urls, fingerprints, storage_options = _resolve_inputs(inputs)

    def build(writer: ArtifactWriter) -> dict:
        started = time.time()
        if not writer.has_shard(MERGED_SHARD):
            units = plan_units(urls, params, storage_options)
            _tokenize_units(writer, units, params, storage_options)
            _merge_units(writer, units, params)
        summary = _read_json(writer, SUMMARY_FILE)
        dtype = summary.pop("dtype")
        summary["seconds"] = round(time.time() - started, 3)
        log.info("tokenize summary: %s", ", ".join(f"{k} {v}" for k, v in summary.items()))
        return {
            "summary": summary,
            "dtype": dtype,
            "outputs": {key: params.output_name(key) for key in params.json_keys},
            "input_files": len(urls),
        }

    return run_stage(store, STAGE, VERSION, params.fingerprint_fields(), fingerprints, build)


# ---------------------------------------------------------------------------------------------------------
# Command line: Megatron's flags


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stages.tokenize", description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument(
        "--input",
        required=True,
        help="a .jsonl/.json(.gz/.zst/.xz/.bz2) or .parquet file, glob or fsspec URL",
    )
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each record")
    group.add_argument("--split-sentences", action="store_true", help="split documents into sentences")
    group.add_argument(
        "--keep-newlines", action="store_true", help="keep newlines between sentences when splitting"
    )
    group.add_argument(
        "--skip-bad-records", action="store_true", help="count and skip bad records instead of stopping"
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", default=None)
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-model", default=None)
    group.add_argument("--vocab-size", type=int, default=None)
    group.add_argument("--vocab-extra-ids", type=int, default=0)
    group.add_argument(
        "--append-eod", action="store_true", help="append an <eod> token to the end of a document"
    )
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", required=True, help="path of the output files without _<key>_<level>.bin"
    )
    group.add_argument("--store", default="./artifacts", help="artifact store URL (cache of stage outputs)")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=TokenizeParams.workers, help="worker processes")
    group.add_argument(
        "--partitions", type=int, default=1, help="cut the input into about this many work units at least"
    )
    group.add_argument(
        "--shard-size-mb", type=float, default=TokenizeParams.shard_size_mb, help="maximum work unit size"
    )
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress log lines")
    return parser.parse_args(argv)


def params_from_args(args: argparse.Namespace) -> TokenizeParams:
    fields = {f.name for f in dataclasses.fields(TokenizeParams)}
    values = {name: value for name, value in vars(args).items() if name in fields}
    values["json_keys"] = tuple(args.json_keys)
    return TokenizeParams(**values)


def export(ref: ArtifactRef, params: TokenizeParams, output_prefix: str) -> list[str]:
    """Copy the artifact's files to `<output-prefix>_<key>_<level>.bin/.idx` (a copy, not a link: a later
    writer truncating the output must not corrupt the store); each file appears complete or not at all."""
    written = []
    for key in params.json_keys:
        for ext in ("bin", "idx"):
            dest = f"{output_prefix}_{key}_{params.level}.{ext}"
            os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
            tmp = f"{dest}.tmp-{uuid.uuid4().hex}"
            shutil.copyfile(ref.local_path(f"{params.output_name(key)}.{ext}"), tmp)
            os.replace(tmp, dest)
            written.append(dest)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    params = params_from_args(args)
    try:
        ref = run(params, args.input, ArtifactStore(args.store))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    summary = ref.manifest()["summary"]
    print(("cache hit: " if ref.cache_hit else "") + ref.url)
    print(
        f"{summary['documents']} documents, {summary['sentences']} sentences, {summary['tokens']} tokens, "
        f"{summary['bytes'] / 2**20:.2f} MB in {summary['seconds']:.1f} s; skipped {summary['skipped_bad_records']} "
        f"bad records, {summary['empty_documents']} empty documents, {summary['invalid_utf8_lines']} lines with invalid UTF-8"
    )
    for path in export(ref, params, args.output_prefix):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
