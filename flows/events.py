"""The Prefect event a corpus refresh emits when it produced new token data (docs/architecture.md).

The pipeline deployment in `prefect.yaml` has a trigger on `TOKENIZED_EVENT`, so a scheduled refresh retrains and
re-evaluates only when the data changed: a refresh whose tokenize stage was a cache hit emits nothing.
"""

from __future__ import annotations

from typing import Any

from prefect.events import Event, emit_event

TOKENIZED_EVENT = "megatron-flow.tokenized-dataset.created"
RESOURCE_PREFIX = "megatron-flow.artifact.tokenize."


def announce_tokenized(tokenize_ref: dict[str, Any]) -> Event | None:
    """Emit `TOKENIZED_EVENT` carrying the artifact reference when the tokenize stage built a new artifact."""
    if tokenize_ref["cache_hit"]:
        return None
    return emit_event(
        event=TOKENIZED_EVENT,
        resource={
            "prefect.resource.id": RESOURCE_PREFIX + tokenize_ref["key"],
            "prefect.resource.name": tokenize_ref["url"],
        },
        payload={"key": tokenize_ref["key"], "url": tokenize_ref["url"], "artifact": tokenize_ref},
    )
