"""The corpus flow's closing table: documents and bytes through each stage, drops, tokens, time, cache hits.

When the clean stage ran a web step (URL filter, extraction, language ID, decontamination, PII), a row per step
follows its row (`clean/url_filter`, ...), with documents in and out and drops by reason, and a line under the
table gives the documents per language.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from storage.artifacts import ArtifactStore


@dataclass
class StageRow:
    stage: str
    cache_hit: bool
    docs_in: int | None = None
    docs_out: int | None = None
    mb_in: float | None = None
    mb_out: float | None = None
    dropped: dict[str, int] = field(default_factory=dict)
    tokens: int | None = None
    seconds: float | None = None
    languages: dict[str, int] = field(default_factory=dict)  # documents per identified language

    @property
    def is_step(self) -> bool:
        """A step inside a stage (`clean/language`), not a stage of its own."""
        return "/" in self.stage


# The clean stage's steps in the order they run; the table shows them when one of the web steps ran.
STEP_ORDER = ("url_filter", "extract", "repair", "language", "decontaminate", "quality", "pii")
WEB_STEPS = frozenset({"url_filter", "extract", "language", "decontaminate", "pii"})


def _row(stage: str, ref: dict[str, Any], manifest: dict[str, Any]) -> StageRow:
    counts = manifest.get("counts") or manifest.get("summary") or {}
    row = StageRow(stage=stage, cache_hit=bool(ref.get("cache_hit")), seconds=manifest.get("seconds"))
    row.docs_in = counts.get("docs_in", counts.get("documents"))
    row.docs_out = counts.get("docs_out", counts.get("docs", counts.get("documents")))
    if "bytes_in" in counts:
        row.mb_in = counts["bytes_in"] / 1e6
    if "bytes_out" in counts or "bytes" in counts:
        row.mb_out = counts.get("bytes_out", counts.get("bytes", 0)) / 1e6
    row.dropped = {k: v for k, v in (counts.get("dropped") or {}).items() if v}
    skipped = counts.get("skipped_bad_records")
    if skipped:
        row.dropped["bad_records"] = skipped
    row.tokens = counts.get("tokens")
    return row


def _step_rows(stage: str, ref: dict[str, Any], manifest: dict[str, Any]) -> list[StageRow]:
    counts = manifest.get("counts") or {}
    steps = counts.get("steps") or {}
    if not WEB_STEPS & steps.keys():
        return []
    rows = []
    for name in (name for name in STEP_ORDER if name in steps):
        step = steps[name]
        row = StageRow(f"{stage}/{name}", bool(ref.get("cache_hit")), step["docs_in"], step["docs_out"])
        row.dropped = {k: v for k, v in step["dropped"].items() if v}
        row.languages = dict(counts.get("languages") or {}) if name == "language" else {}
        rows.append(row)
    return rows


def summarize(refs: dict[str, dict[str, Any]], store_url: str) -> list[StageRow]:
    """One row per stage, followed by its steps' rows (`_step_rows`)."""
    store = ArtifactStore(store_url)
    rows = []
    for stage, ref in refs.items():
        manifest = store.ref(ref).manifest()
        rows += [_row(stage, ref, manifest), *_step_rows(stage, ref, manifest)]
    return rows


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def summary_table(rows: list[StageRow]) -> str:
    header = ("stage", "cache", "docs in", "docs out", "MB in", "MB out", "dropped", "tokens", "seconds")
    lines = [
        (
            r.stage,
            "hit" if r.cache_hit else "ran",
            _fmt(r.docs_in, ","),
            _fmt(r.docs_out, ","),
            _fmt(r.mb_in, ".2f"),
            _fmt(r.mb_out, ".2f"),
            ", ".join(f"{k}={v}" for k, v in sorted(r.dropped.items())) or "-",
            _fmt(r.tokens, ","),
            _fmt(r.seconds, ".1f"),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt_line = lambda cells: " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    stages = [r for r in rows if not r.is_step]
    languages = [
        f"documents per language ({r.stage}): "
        + ", ".join(f"{k}={v}" for k, v in sorted(r.languages.items()))
        for r in rows
        if r.languages
    ]
    return "\n".join(
        [
            fmt_line(header),
            "-+-".join("-" * w for w in widths),
            *map(fmt_line, lines),
            *languages,
            f"cache hits: {sum(r.cache_hit for r in stages)}/{len(stages)} stages",
        ]
    )
