"""Task records and the model inputs built from them, as Megatron's tasks/data_utils.py.

A record is what a reader yields from a file line or a Hugging Face row; a sample is the tokenized
`[CLS] A [SEP] B [SEP]` with token types, padding mask and label. A RACE question is one record with four
options and becomes four sequences stacked along a choice axis.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from megatron_train.tokenizer import MegatronTokenizer

MAX_QA_LENGTH = 128  # Megatron's RACE: question + option tokens kept before the article


class TaskDataError(ValueError):
    """A task file or record that cannot be read: names the file, the line or record, and the field."""

    def __init__(self, source: str, where: str, problem: str) -> None:
        super().__init__(f"{source}: {where}: {problem}")


def _regular_file(path: str, what: str) -> None:
    if not os.path.isfile(path):
        kind = "a folder" if os.path.isdir(path) else "not a regular file"
        raise TaskDataError(path, "file", f"{kind}, not {what}; move it out of the task's data folder")


def _utf8(path: str, data: bytes, first_line: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + data[: error.start].count(b"\n")
        raise TaskDataError(
            path,
            f"line {line}",
            f"byte {error.start} is not UTF-8 ({error.reason}); re-encode the file as UTF-8",
        ) from None


def read_text_file(path: str, limit: int, what: str) -> str:
    """A task file's text, whole: a regular file of at most `limit` bytes, in UTF-8; any other is an error
    naming the file (and the line of a byte that is not UTF-8)."""
    _regular_file(path, what)
    size = os.path.getsize(path)
    if size > limit:
        raise TaskDataError(path, "file", f"{size} bytes, over the {limit} bytes of {what}; it is not one")
    with open(path, "rb") as handle:
        return _utf8(path, handle.read(), 1)


def read_text_lines(path: str, max_line_bytes: int, what: str) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline) of a task file read line by line, each line at most
    `max_line_bytes` and in UTF-8; any other is an error naming the file and the line."""
    _regular_file(path, what)
    with open(path, "rb") as handle:
        for number, raw in enumerate(iter(lambda: handle.readline(max_line_bytes + 1), b""), start=1):
            if len(raw) > max_line_bytes:
                raise TaskDataError(
                    path, f"line {number}", f"over {max_line_bytes} bytes: not a line of {what}"
                )
            yield number, _utf8(path, raw, number).rstrip("\r\n")


@dataclass(frozen=True)
class PairRecord:
    """A GLUE sentence pair with its class id."""

    uid: int
    text_a: str
    text_b: str
    label: int


@dataclass(frozen=True)
class ChoiceRecord:
    """A RACE question: the article, the question, its options and the index of the right one."""

    uid: int
    article: str
    question: str
    options: tuple[str, ...]
    label: int


def clean_text(text: str) -> str:
    """Megatron's clean-up: newlines and runs of spaces become one space, ' . ' becomes '. '."""
    text = re.sub(r"\s+", " ", text.replace("\n", " "))
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def tokens_types_paddings(
    ids_a: list[int], ids_b: list[int] | None, seq_length: int, tokenizer: MegatronTokenizer
) -> tuple[list[int], list[int], list[int]]:
    """Megatron's `build_tokens_types_paddings_from_ids`: `[CLS] A [SEP] B [SEP]` cut to `seq_length` (a cut
    sequence still ends in [SEP]), token types 0 for A and 1 for B, padded with [PAD] and padding mask 0."""
    ids = [tokenizer.cls, *ids_a, tokenizer.sep]
    types = [0] * len(ids)
    if ids_b is not None:
        ids += ids_b
        types += [1] * len(ids_b)
    trimmed = len(ids) >= seq_length
    if trimmed:
        ids, types = ids[: seq_length - 1], types[: seq_length - 1]
    if ids_b is not None or trimmed:
        ids.append(tokenizer.sep)
        types.append(0 if ids_b is None else 1)
    paddings = [1] * len(ids)
    padding = seq_length - len(ids)
    ids += [tokenizer.pad] * padding
    types += [0] * padding  # Megatron pads with the pad id, out of range of 2 token types if it is not 0
    paddings += [0] * padding
    return ids, types, paddings


def sample_arrays(
    ids: list, types: list, paddings: list, label: int, uid: int
) -> dict[str, np.ndarray | int]:
    return {
        "text": np.asarray(ids, dtype=np.int64),
        "types": np.asarray(types, dtype=np.int64),
        "padding_mask": np.asarray(paddings, dtype=np.int64),
        "label": int(label),
        "uid": int(uid),
    }


def pair_sample(record: PairRecord, tokenizer: MegatronTokenizer, seq_length: int) -> dict:
    ids, types, paddings = tokens_types_paddings(
        tokenizer.tokenize(record.text_a), tokenizer.tokenize(record.text_b), seq_length, tokenizer
    )
    return sample_arrays(ids, types, paddings, record.label, record.uid)


def choice_sample(record: ChoiceRecord, tokenizer: MegatronTokenizer, seq_length: int) -> dict:
    """Megatron's RACE sample: per option, `[CLS] question+option [SEP] article [SEP]` (an option fills the
    question's `_` blank when it has one); arrays [choices, seq_length]."""
    article = tokenizer.tokenize(clean_text(record.article))
    rows = []
    for option in record.options:
        if "_" in record.question:
            qa = record.question.replace("_", option)
        else:
            qa = f"{record.question} {option}"
        qa_ids = tokenizer.tokenize(clean_text(qa))[:MAX_QA_LENGTH]
        rows.append(tokens_types_paddings(qa_ids, article, seq_length, tokenizer))
    ids, types, paddings = zip(*rows, strict=True)
    return sample_arrays(list(ids), list(types), list(paddings), record.label, record.uid)


def build_samples(
    records: list[PairRecord | ChoiceRecord], tokenizer: MegatronTokenizer, seq_length: int
) -> list[dict]:
    """Every record tokenized (GLUE and RACE sets are small enough to hold, as Megatron does)."""
    return [
        choice_sample(record, tokenizer, seq_length)
        if isinstance(record, ChoiceRecord)
        else pair_sample(record, tokenizer, seq_length)
        for record in records
    ]
