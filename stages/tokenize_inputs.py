"""The tokenize stage's inputs: which document files it reads, and how they are cut into work units.

Each input file is cut into units of at most `--shard-size-mb` and of about 1/max(`--partitions`,
8 x `--workers`) of the input, so the workers stay busy to the end: byte ranges of plain JSON Lines at line
boundaries (found in one streaming pass), line ranges of compressed JSON Lines (at most `--workers` per file,
since each worker decompresses its file from the top), groups of row groups of Parquet. The same files and
settings always give the same cut; a unit's name says its range, so a different cut never reuses a stale shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import fsspec
import pyarrow.parquet as pq

from stages.shards import document_shards, shard_file
from stages.tokenize_params import TokenizeParams
from storage.artifacts import ArtifactRef
from storage.documents import Span, document_format, expand_inputs, is_compressed
from storage.fingerprint import source_fingerprint

READ_BLOCK_BYTES = 1 << 20
UNITS_PER_WORKER = 8


@dataclass(frozen=True)
class WorkUnit:
    """One span of one input file: what a worker tokenizes into one partial `.bin/.idx`."""

    file_index: int
    url: str
    span: Span

    @property
    def name(self) -> str:
        """Sorts in input order; names the range, so a different cut never reuses a stale shard."""
        return f"{self.file_index:05d}-{self.span.start:013d}-{self.span.stop:013d}"


def resolve_inputs(inputs) -> tuple[list[str], list[ArtifactRef | str], dict]:
    """(document file URLs, fingerprints for the key, storage options) of the stage's inputs: artifacts of
    Parquet document shards, or files, globs and URLs (one, or a list of them)."""
    items = [inputs] if isinstance(inputs, (str, ArtifactRef)) else list(inputs)
    urls: list[str] = []
    fingerprints: list[ArtifactRef | str] = []
    storage_options: dict = {}
    for item in items:
        if isinstance(item, ArtifactRef):
            urls.extend(item.file_url(shard_file(name)) for name in document_shards(item))
            storage_options = item.storage_options
            fingerprints.append(item)
        else:
            urls.extend(expand_inputs(item))
            fingerprints.append(source_fingerprint(item))
    return urls, fingerprints, storage_options


def _plan_jsonl(file_index: int, url: str, unit_bytes: int, storage_options: dict) -> list[WorkUnit]:
    """Cut a plain JSON Lines file at the first line boundary after every `unit_bytes`."""
    units: list[WorkUnit] = []
    start, first_line, lines_before_block, position = 0, 1, 0, 0

    def cut(stop: int, lines_through: int) -> None:
        nonlocal start, first_line
        units.append(WorkUnit(file_index, url, Span(start, stop, first_line, lines_through - first_line + 1)))
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
    return [WorkUnit(file_index, url, Span(a, b, a + 1, b - a)) for a, b in pairwise(bounds) if b > a]


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
            units.append(WorkUnit(file_index, url, Span(start, group + 1, first_row, rows)))
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
        elif document_format(url) == "text":  # one document: one unit
            units.append(WorkUnit(file_index, url, Span(0, 1, 1, 1)))
        elif is_compressed(url):
            units += _plan_compressed_jsonl(file_index, url, unit_bytes, params.workers, storage_options)
        else:
            units += _plan_jsonl(file_index, url, unit_bytes, storage_options)
    return units
