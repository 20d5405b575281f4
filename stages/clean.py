"""Clean stage: repair and normalise text, then drop low-quality documents (stages/quality_filters.py).

Per input shard, in parallel: ftfy fixes mojibake, Unicode is normalised (NFC by default), control
characters go, whitespace is tidied; then the first quality rule that fails drops the document. The manifest
counts documents and bytes in and out and the documents each rule dropped.
"""

from __future__ import annotations

import os
import re
import time
import unicodedata
from dataclasses import dataclass

import ftfy

from stages.base import Inputs, Stage, expect_inputs
from stages.quality_filters import RULES, QualityParams, first_failing_rule
from stages.shards import (
    MapShards,
    document_shards,
    log,
    process_pool,
    run_shards,
    shard_file,
    shard_stats,
    stats_file,
    sum_counts,
    write_json,
)
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter
from storage.documents import iter_records, write_parquet_shard

# C0/C1 control characters other than tab and newline, plus zero-width and BOM characters.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b\u200e\u200f\u2028\u2029\ufeff]")
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]+")
_TRAILING_SPACE = re.compile(r" *\n *")
_BLANK_LINES = re.compile(r"\n{3,}")


@dataclass(frozen=True)
class CleanParams(QualityParams):
    """Text repair switches, plus the quality rules' thresholds (inherited from QualityParams, so every
    rule is a flat parameter of the stage: `--clean.min-words`)."""

    fix_text: bool = True  # ftfy: mojibake, HTML entities, curly quotes kept
    unicode_normalization: str | None = "NFC"  # NFC, NFKC, NFD, NFKD or None
    remove_control_chars: bool = True
    normalize_whitespace: bool = True  # runs of spaces -> one, no spaces around newlines, <= 1 blank line


def clean_text(text: str, params: CleanParams) -> str:
    """The repaired text (before quality filtering)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if params.fix_text:
        text = ftfy.fix_text(text, normalization=None, uncurl_quotes=False)
    if params.unicode_normalization:
        text = unicodedata.normalize(params.unicode_normalization, text)
    if params.remove_control_chars:
        text = _CONTROL.sub("", text)
    if params.normalize_whitespace:
        text = _BLANK_LINES.sub("\n\n", _TRAILING_SPACE.sub("\n", _SPACES.sub(" ", text))).strip()
    return text


def clean_shard(writer: ArtifactWriter, source: ArtifactRef, name: str, params: CleanParams) -> dict:
    """Clean one input shard and commit `shards/<name>.parquet` with its counts `stats/<name>.json`."""
    started = time.time()
    dropped = dict.fromkeys(["empty", *RULES], 0)
    counts = {"docs_in": 0, "docs_out": 0, "bytes_in": 0, "bytes_out": 0}
    kept = []
    for record in iter_records(source.local_path(shard_file(name))):
        doc = record.data
        counts["docs_in"] += 1
        counts["bytes_in"] += len(doc["text"].encode())
        text = clean_text(doc["text"], params)
        rule = "empty" if not text else first_failing_rule(text, params)
        if rule is not None:
            dropped[rule] += 1
            continue
        kept.append({**doc, "text": text})
        counts["docs_out"] += 1
        counts["bytes_out"] += len(text.encode())
    stats = {**counts, "dropped": dropped, "seconds": round(time.time() - started, 3)}
    scratch = os.path.join(writer.local_dir, name)
    files = {
        shard_file(name): os.path.join(scratch, "docs.parquet"),
        stats_file(name): os.path.join(scratch, "stats.json"),
    }
    write_parquet_shard(kept, files[shard_file(name)])
    write_json(stats, files[stats_file(name)])
    writer.commit_shard(name, files)
    return stats


class CleanStage(Stage):
    name = "clean"
    version = "1"
    Params = CleanParams
    maps_shards = True

    def run(
        self,
        params: CleanParams,
        inputs: Inputs,
        store: ArtifactStore,
        map_shards: MapShards | None = None,
    ) -> ArtifactRef:
        """Clean the documents of one upstream artifact (download's), shard by shard, in parallel
        (`map_shards`: a local process pool unless a flow passes its own)."""
        (source,) = expect_inputs(self, inputs, 1, "one artifact of document shards (download's)")
        map_shards = map_shards or process_pool()

        def build(writer: ArtifactWriter) -> dict:
            names = document_shards(source)
            run_shards(writer, clean_shard, [(writer, source, n, params) for n in names], names, map_shards)
            total = sum_counts(shard_stats(writer, names))
            seconds = total.pop("seconds")
            log.info(
                "clean: %d of %d documents kept, %.1f of %.1f MB (%.0f docs per CPU second)",
                total["docs_out"],
                total["docs_in"],
                total["bytes_out"] / 1e6,
                total["bytes_in"] / 1e6,
                total["docs_in"] / max(seconds, 1e-9),
            )
            return {
                "counts": total,
                "throughput": {"docs_per_cpu_s": round(total["docs_in"] / max(seconds, 1e-9), 1)},
            }

        return self.build_artifact(params, [source], store, build)


STAGE = CleanStage()
run = STAGE.run
key = STAGE.key
