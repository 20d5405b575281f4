"""What a flow run left in Prefect, read back through the Prefect API: its stage tasks' states, its artifacts."""

from __future__ import annotations

import json
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.client.schemas.objects import State


def task_states(flow_state: State) -> dict[str, str]:
    """Stage task run name -> state name (Completed, Cached...) of the flow run that ended in `flow_state`."""
    flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=flow_run)
    return {run.name: run.state.name for run in runs if run.task_key.startswith("run_stage_task")}


def artifacts(flow_state: State) -> dict[str, tuple[str, Any]]:
    """Artifact key -> (type, data) of the flow run; table data is decoded from JSON."""
    flow_run = ArtifactFilterFlowRunId(any_=[flow_state.state_details.flow_run_id])
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=flow_run))
    return {a.key: (a.type, json.loads(a.data) if a.type == "table" else a.data) for a in found}
