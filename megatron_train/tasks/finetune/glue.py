"""GLUE TSV files as Megatron's tasks/glue reads them: MNLI (train.tsv, dev_matched.tsv, dev_mismatched.tsv)
and QQP (train.tsv, dev.tsv); test files (no label column) get the task's test label, as in Megatron.

Columns are found by their header names, so an error names the file, the line and the column.
"""

from __future__ import annotations

import os

from megatron_train.tasks.finetune.samples import PairRecord, TaskDataError, clean_text, read_text_lines

MNLI_LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}  # Megatron's ids
QQP_LABELS = {"0": 0, "1": 1}
MAX_LINE_BYTES = 1 << 20  # a sentence pair and its label: a few hundred bytes


def read_tsv_rows(path: str, columns: tuple[str, ...]) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """(header, [(line number, cells)]) of a GLUE TSV; a missing file or header column is named."""
    if not os.path.exists(path):
        raise TaskDataError(
            path, "file", "no such file; pass the GLUE task's .tsv files to --train-data/--valid-data"
        )
    lines = [line for _, line in read_text_lines(path, MAX_LINE_BYTES, "a GLUE TSV file")]
    if not lines:
        raise TaskDataError(path, "line 1", "empty file; expected a header row of tab-separated column names")
    header = [cell.strip() for cell in lines[0].split("\t")]
    for column in columns:
        if column not in header:
            raise TaskDataError(path, "line 1", f"no column {column!r} in the header {header}")
    return header, [(number, line.split("\t")) for number, line in enumerate(lines[1:], 2) if line.strip()]


def _cell(path: str, line: int, header: list[str], cells: list[str], column: str) -> str:
    if len(cells) != len(header):
        raise TaskDataError(path, f"line {line}", f"{len(cells)} fields but the header has {len(header)}")
    value = clean_text(cells[header.index(column)].strip())
    if not value:
        raise TaskDataError(path, f"line {line}", f"field {column!r} is empty")
    return value


def _uid(path: str, line: int, header: list[str], cells: list[str], column: str) -> int:
    value = _cell(path, line, header, cells, column)
    if not value.isdigit():
        raise TaskDataError(
            path, f"line {line}", f"field {column!r} is {value!r}, not a non-negative integer id"
        )
    return int(value)


def _label(path: str, line: int, value: str, column: str, labels: dict[str, int]) -> int:
    if value not in labels:
        raise TaskDataError(
            path, f"line {line}", f"field {column!r} is {value!r}, not one of {sorted(labels)}"
        )
    return labels[value]


def read_pairs(
    path: str, uid: str, text_a: str, text_b: str, label: str, labels: dict[str, int], test_label: str
) -> list[PairRecord]:
    """The pairs of one GLUE file; without a `label` column (a test file) every pair gets `test_label`."""
    header, rows = read_tsv_rows(path, (uid, text_a, text_b))
    has_label = label in header
    records = []
    for line, cells in rows:
        value = _cell(path, line, header, cells, label) if has_label else test_label
        records.append(
            PairRecord(
                _uid(path, line, header, cells, uid),
                _cell(path, line, header, cells, text_a),
                _cell(path, line, header, cells, text_b),
                _label(path, line, value, label, labels),
            )
        )
    return records


def read_mnli(path: str) -> list[PairRecord]:
    return read_pairs(path, "index", "sentence1", "sentence2", "gold_label", MNLI_LABELS, "contradiction")


def read_qqp(path: str) -> list[PairRecord]:
    return read_pairs(path, "id", "question1", "question2", "is_duplicate", QQP_LABELS, "0")


def glue_split_name(path: str) -> str:
    """Megatron's name for a GLUE file in the accuracy lines: dev_matched.tsv -> dev-matched."""
    return os.path.basename(path).removesuffix(".tsv").replace("_", "-")
