"""The Prefect event a corpus refresh emits when it produced new token data (docs/architecture.md).

The pipeline deployment in `prefect.yaml` has a trigger on `TOKENIZED_EVENT`, so a scheduled refresh retrains and
re-evaluates only when the data changed: a refresh whose tokenize stage was a cache hit emits nothing, and neither
does a corpus run inside another flow (a pipeline or pretrain run trains on the data it built itself; announcing
it would start a second pipeline run).
"""

from __future__ import annotations

from typing import Any

from prefect.context import FlowRunContext
from prefect.events import Event, emit_event

TOKENIZED_EVENT = "megatron-flow.tokenized-dataset.created"
RESOURCE_PREFIX = "megatron-flow.artifact.tokenize."


def announce_tokenized(tokenize_ref: dict[str, Any]) -> Event | None:
    """Emit `TOKENIZED_EVENT` carrying the artifact reference when the tokenize stage built a new artifact, from a
    flow run that is not part of another."""
    context = FlowRunContext.get()
    if tokenize_ref["cache_hit"] or (context is not None and context.flow_run.parent_task_run_id is not None):
        return None
    return emit_event(
        event=TOKENIZED_EVENT,
        resource={
            "prefect.resource.id": RESOURCE_PREFIX + tokenize_ref["key"],
            "prefect.resource.name": tokenize_ref["url"],
        },
        payload={"key": tokenize_ref["key"], "url": tokenize_ref["url"], "artifact": tokenize_ref},
    )
