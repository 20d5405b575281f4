"""A small GPT corpus for the Prefect flow tests: real KJV chapters from the embedded corpus that pass the
default clean step, and the corpus flow's config over a given source."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

from flows.corpus import CorpusConfig
from stages.clean import CleanParams, clean_text
from stages.download import EMBEDDED_CORPUS, DownloadParams
from stages.quality_filters import first_failing_rule
from stages.tokenize import TokenizeParams


def clean_chapters(count: int = 30) -> list[dict]:
    """Real KJV chapters that pass the default clean step (so flow tests can expect exact counts)."""
    chapters = []
    with lzma.open(EMBEDDED_CORPUS, "rt") as f:
        for line in f:
            doc = json.loads(line)
            text = clean_text(doc["text"], CleanParams())
            if 400 < len(text.split()) < 1200 and first_failing_rule(text, CleanParams()) is None:
                chapters.append({"id": doc["id"], "text": doc["text"]})
            if len(chapters) == count:
                return chapters
    raise AssertionError("not enough clean chapters in the embedded corpus")


def corpus_config(store: Path, source: Path, **overrides) -> CorpusConfig:
    """The corpus flow over `source` into `store`: 16 documents per shard, bad records skipped, threads."""
    base = {
        "store": str(store),
        "download": DownloadParams(source=str(source), docs_per_shard=16, skip_bad_records=True),
        "tokenize": TokenizeParams(append_eod=True, workers=1),
        "task_runner": "threads",
    }
    return CorpusConfig(**{**base, **overrides})
