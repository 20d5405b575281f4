"""What a flow run left in Prefect, read back through the Prefect API: its stage tasks' states, its artifacts."""

from __future__ import annotations

import json
import time
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.client.schemas.objects import State


def task_states(flow_state: State, timeout: float = 60.0) -> dict[str, str]:
    """Stage task run name -> final state name (Completed, Cached...) of the flow run that ended in `flow_state`.
    Task runs report their states to the server as events, which a busy machine delivers seconds after the flow
    returned: the states are read again until none is still running (or `timeout` passed)."""
    flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id]))
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = [
                r
                for r in client.read_task_runs(flow_run_filter=flow_run)
                if r.task_key.startswith("run_stage_task")
            ]
            if all(run.state.is_final() for run in runs) or time.monotonic() > deadline:
                return {run.name: run.state.name for run in runs}
            time.sleep(0.5)


def artifacts(flow_state: State) -> dict[str, tuple[str, Any]]:
    """Artifact key -> (type, data) of the flow run; table data is decoded from JSON."""
    flow_run = ArtifactFilterFlowRunId(any_=[flow_state.state_details.flow_run_id])
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=flow_run))
    return {a.key: (a.type, json.loads(a.data) if a.type == "table" else a.data) for a in found}
