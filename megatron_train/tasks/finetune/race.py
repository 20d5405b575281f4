"""RACE in its official layout, as Megatron's tasks/race reads it: `RACE/{train,dev,test}/{middle,high}/*.txt`,
each file one JSON object with `article`, `questions`, `options` (four per question) and `answers` (letters).
`--train-data` / `--valid-data` take the leaf folders (RACE/dev/middle RACE/dev/high).
"""

from __future__ import annotations

import glob
import json
import os

from megatron_train.tasks.finetune.samples import ChoiceRecord, TaskDataError, read_text_file

NUM_CHOICES = 4
FIELDS = ("article", "questions", "options", "answers")
MAX_FILE_BYTES = 16 << 20  # one article and its questions: a few kilobytes


def read_race_file(path: str, first_uid: int) -> list[ChoiceRecord]:
    """The questions of one RACE file, numbered from `first_uid`; a bad field is named with its question."""
    text = read_text_file(path, MAX_FILE_BYTES, "a RACE file (one JSON article with its questions)")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise TaskDataError(path, f"line {error.lineno}", f"not JSON ({error.msg})") from None
    if not isinstance(document, dict):
        raise TaskDataError(path, "record", f"expected a JSON object with {list(FIELDS)}")
    for field in FIELDS:
        if field not in document:
            raise TaskDataError(path, "record", f"no field {field!r} (a RACE file has {list(FIELDS)})")
    article, questions, options, answers = (document[field] for field in FIELDS)
    if not isinstance(article, str) or not article.strip():
        raise TaskDataError(path, "record", "field 'article' must be non-empty text")
    if not isinstance(questions, list):
        raise TaskDataError(
            path, "record", f"field 'questions' must be a list of questions, got {questions!r:.60}"
        )
    for field in ("questions", "options", "answers"):
        if not isinstance(document[field], list) or len(document[field]) != len(questions):
            raise TaskDataError(
                path,
                "record",
                f"field {field!r} must be a list with one entry per question ({len(questions)})",
            )
    records = []
    for number, (question, choices, answer) in enumerate(zip(questions, options, answers, strict=True)):
        where = f"question {number}"
        if not isinstance(choices, list) or len(choices) != NUM_CHOICES:
            raise TaskDataError(
                path, where, f"field 'options' must hold {NUM_CHOICES} options, got {choices!r}"
            )
        letters = [chr(ord("A") + i) for i in range(NUM_CHOICES)]
        if answer not in letters:
            raise TaskDataError(path, where, f"field 'answers' is {answer!r}, not one of {letters}")
        records.append(
            ChoiceRecord(
                first_uid + number, article, str(question), tuple(map(str, choices)), letters.index(answer)
            )
        )
    return records


def read_race(folder: str) -> list[ChoiceRecord]:
    """Every question of the `*.txt` files of one RACE folder, in file-name order."""
    if not os.path.isdir(folder):
        raise TaskDataError(
            folder, "folder", "no such folder; pass RACE/<split>/middle and RACE/<split>/high"
        )
    paths = sorted(glob.glob(os.path.join(folder, "*.txt")))
    if not paths:
        raise TaskDataError(
            folder, "folder", "no *.txt files; pass the RACE/<split>/middle or .../high folder"
        )
    records: list[ChoiceRecord] = []
    for path in paths:
        records += read_race_file(path, len(records))
    return records


def race_split_name(folder: str) -> str:
    """Megatron's name for a RACE folder in the accuracy lines: RACE/dev/middle -> dev-middle."""
    parts = os.path.normpath(folder).split(os.sep)
    return "-".join(parts[-2:])
