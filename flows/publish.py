"""What a flow shows in the Prefect UI: the stage summary as a table artifact, each stage's artifact as a link,
and the evaluation report as a markdown artifact (docs/architecture.md).

Artifact keys are stable (`corpus-summary`, `tokenize-artifact`, `evaluation-report`, `retro-report`...), so the UI keeps each
one's history across runs and shows the latest first.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from flows.summary import summarize
from storage.artifacts import ArtifactStore

LOSS_CURVES = "loss_curves.png"


def link_url(url: str) -> str:
    """A URL a browser can follow: local paths as file:// URIs, store URLs (s3://...) as they are."""
    return url if "://" in url else Path(url).resolve().as_uri()


def artifact_key(name: str) -> str:
    """Prefect artifact keys take lowercase letters, digits and dashes only."""
    return name.lower().replace("_", "-")


def publish_stages(flow_name: str, refs: dict[str, dict[str, Any]], store_url: str) -> None:
    """The flow's stage summary as a table, and one link per stage to where its artifact lies."""
    rows = []
    summary = summarize(refs, store_url)
    for row in summary:
        values = dataclasses.asdict(row)
        values["cache_hit"] = "hit" if row.cache_hit else "ran"
        for name in ("dropped", "languages"):
            values[name] = ", ".join(f"{k}={v}" for k, v in sorted(values[name].items())) or "-"
        rows.append(values)
    stages = [row for row in summary if not row.is_step]
    hits = sum(row.cache_hit for row in stages)
    create_table_artifact(
        table=rows,
        key=artifact_key(f"{flow_name}-summary"),
        description=f"{flow_name}: documents, drops, tokens and time per stage; cache hits {hits}/{len(stages)}",
    )
    for stage, ref in refs.items():
        create_link_artifact(
            link=link_url(ref["url"]),
            link_text=ref["url"],
            key=artifact_key(f"{stage}-artifact"),
            description=f"the {stage} stage's artifact (key {ref['key']})",
        )


def publish_report(
    evaluate_ref: dict[str, Any],
    store_url: str,
    key: str = "evaluation-report",
    description: str = "metrics, loss curves and sample generations",
) -> None:
    """An evaluation stage's Markdown report, its images (loss curves, and any other PNG of the artifact) linked
    where the files lie."""
    evaluate = ArtifactStore(store_url).ref(evaluate_ref)
    curves = link_url(evaluate.file_url(LOSS_CURVES))
    markdown = Path(evaluate.local_path("report.md")).read_text()
    for name in (name for name in evaluate.files() if name.endswith(".png")):
        markdown = markdown.replace(f"]({name})", f"]({link_url(evaluate.file_url(name))})")
    markdown += f"\n[Loss curves (PNG)]({curves}) · [report.md]({link_url(evaluate.file_url('report.md'))})\n"
    create_markdown_artifact(markdown=markdown, key=key, description=description)
