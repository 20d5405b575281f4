"""Downstream-task decontamination of the clean stage: n-gram overlap with the evaluation sets a user names.

As the GPT-3 paper (appendix C) and Megatron-LM's `tools/openwebtext/filter_ngrams.py`: texts are lower-cased
words (`\\w+` runs, so punctuation and WikiText's `@-@` tokenisation do not matter); a document that shares one
word n-gram (13 by default) with an evaluation set is contaminated. It is dropped (the default) or, in `split`
mode, cut around every matching n-gram: the pieces of at least `MIN_PIECE_CHARS` characters become documents
of their own, and a document cut into more than `MAX_PIECES` pieces is dropped (Megatron's limits).

Evaluation files in their usual formats: LAMBADA (`.jsonl`, a `text` field per line), WikiText-103
(`wiki.test.tokens`) or any other text file (read whole), MNLI (GLUE `.tsv`: `sentence1`, `sentence2`), RACE (a
folder of its `.txt` files, or one file: a JSON object with `article`, `questions`, `options`). A document is
counted under the first file (in the order given) that shares an n-gram with it: `contaminated_<file stem>`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fsspec
import numpy as np
import xxhash

from stages.quality_filters import ngram_keys

MIN_PIECE_CHARS = 200
MAX_PIECES = 10
_WORD = re.compile(r"\w+")
_NOT_A_TO_Z = re.compile(r"[^a-z]+")
_TRAILING_PUNCTUATION = ".,;:!?)]} \n\t"


def reason_name(path: str) -> str:
    """`contaminated_<stem>` in [a-z_]: lambada_test.jsonl -> contaminated_lambada_test."""
    stem = os.path.basename(os.path.normpath(path)).split(".")[0]
    return "contaminated_" + (_NOT_A_TO_Z.sub("_", stem.lower()).strip("_") or "file")


def reason_names(paths: Sequence[str], flag: str) -> list[str]:
    """The reason of each file; two files that would share one are an error naming both."""
    names = [reason_name(path) for path in paths]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(
                f"{flag}: {paths[names.index(name)]} and {paths[i]} would both be counted as {name}; "
                "give the files names that differ in their letters"
            )
    return names


def _jsonl_texts(path: str) -> Iterator[str]:
    with fsspec.open(path, "rt", encoding="utf-8", compression="infer") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(
                    f'{path}:{number}: expected a JSON object with a "text" field ({error})'
                ) from None
            if not isinstance(text, str):
                raise ValueError(f'{path}:{number}: the "text" field is {type(text).__name__}, not a string')
            yield text


def _race_texts(records) -> Iterator[str]:
    for record in records:
        yield record.article
        yield record.question
        yield from record.options


def evaluation_texts(path: str) -> Iterator[str]:
    """The texts of one evaluation set, by its format (module docstring)."""
    from megatron_train.tasks.finetune.glue import read_mnli
    from megatron_train.tasks.finetune.race import read_race, read_race_file

    if os.path.isdir(path):
        yield from _race_texts(read_race(path))
        return
    if path.endswith(".tsv"):
        for pair in read_mnli(path):
            yield pair.text_a
            yield pair.text_b
        return
    if path.endswith((".jsonl", ".jsonl.gz", ".json")):
        yield from _jsonl_texts(path)
        return
    with fsspec.open(path, "rt", encoding="utf-8", errors="replace", compression="infer") as f:
        text = f.read()
    if text.lstrip().startswith("{") and '"article"' in text:
        yield from _race_texts(read_race_file(path, 0))
        return
    yield text


def word_spans(text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(64-bit hash of each lower-cased word, its character span) of a text."""
    matches = list(_WORD.finditer(text))
    hashes = np.fromiter(
        (xxhash.xxh64_intdigest(m.group().lower().encode()) for m in matches), np.uint64, len(matches)
    )
    return hashes, [m.span() for m in matches]


@dataclass(frozen=True)
class NgramIndex:
    """Every n-gram of the evaluation sets (sorted keys) and the first file that holds each."""

    n: int
    keys: np.ndarray  # uint64, sorted, unique
    files: np.ndarray  # int32: index of the first file (in the order given) with that n-gram

    @classmethod
    def build(cls, paths: Sequence[str], n: int, flag: str = "--clean.decontaminate") -> NgramIndex:
        keys, files = [], []
        for index, path in enumerate(paths):
            if not os.path.exists(path) and "://" not in path:
                raise FileNotFoundError(f"{flag}: {path}: no such evaluation file or folder")
            for text in evaluation_texts(path):
                hashes, _ = word_spans(text)
                if len(hashes) >= n:
                    keys.append(ngram_keys(hashes, n))
                    files.append(np.full(len(keys[-1]), index, np.int32))
        if not keys:
            return cls(n, np.zeros(0, np.uint64), np.zeros(0, np.int32))
        all_keys, all_files = np.concatenate(keys), np.concatenate(files)
        order = np.lexsort((all_files, all_keys))
        unique, first = np.unique(all_keys[order], return_index=True)
        return cls(n, unique, all_files[order][first])

    def match(self, hashes: np.ndarray) -> tuple[int, np.ndarray] | None:
        """(first file matched, start of every matching n-gram) of a document's word hashes, or None."""
        if len(hashes) < self.n or not len(self.keys):
            return None
        doc = ngram_keys(hashes, self.n)
        where = np.minimum(np.searchsorted(self.keys, doc), len(self.keys) - 1)
        hit = self.keys[where] == doc
        if not hit.any():
            return None
        return int(self.files[where[hit]].min()), np.flatnonzero(hit)


def split_around(text: str, spans: list[tuple[int, int]], starts: np.ndarray, n: int) -> list[str] | None:
    """The pieces of `text` between its matching n-grams that are long enough to keep, or None when the text
    falls into more than MAX_PIECES pieces."""
    depth = np.zeros(len(spans) + 1, np.int64)
    np.add.at(depth, starts, 1)
    np.add.at(depth, starts + n, -1)
    removed = (np.cumsum(depth[:-1]) > 0).astype(np.int8)
    edges = np.diff(np.concatenate(([0], removed, [0])))
    pieces, begin = [], 0
    for first, stop in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True):
        pieces.append(text[begin : spans[first][0]].strip())
        begin = spans[stop - 1][1]
    pieces.append(text[begin:].strip())
    pieces = [piece.lstrip(_TRAILING_PUNCTUATION) for piece in pieces]  # the match's full stop is not a start
    if sum(bool(piece) for piece in pieces) > MAX_PIECES:
        return None
    return [piece for piece in pieces if len(piece) >= MIN_PIECE_CHARS]
