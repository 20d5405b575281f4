"""The Docker and Kubernetes work-pool job templates for GPU nodes (deploy/): valid base job templates that keep
every setting of Prefect's default template for their type, and that render to a job claiming the node's GPUs
with torchrun's process count in NPROC_PER_NODE (what the pretrain flow reads)."""

from __future__ import annotations

import json
from pathlib import Path

import prefect.server.api
import pytest
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.utilities.schema_tools import ValidationError, validate
from prefect.utilities.templating import apply_values

from flows.pretrain import PretrainFlowConfig

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = {
    "docker": "deploy/docker-gpu-job-template.json",
    "kubernetes": "deploy/kubernetes-gpu-job-template.json",
}
# Prefect's own offline copy of every worker type's default template (`prefect work-pool get-default-base-job-template`).
WORKER_METADATA = (
    Path(prefect.server.api.__file__).parent / "collections_data/views/aggregate-worker-metadata.json"
)


def _template(kind: str) -> dict:
    return json.loads((ROOT / TEMPLATES[kind]).read_text())


def _default(kind: str) -> dict:
    for collection in json.loads(WORKER_METADATA.read_text()).values():
        for worker in collection.values():
            if worker["type"] == kind:
                return worker["default_base_job_configuration"]
    raise AssertionError(f"Prefect ships no default template for {kind}")


def _render(template: dict, job_variables: dict) -> dict:
    """The job configuration a worker builds: the variables' defaults, then the deployment's job variables."""
    properties = template["variables"]["properties"]
    defaults = {name: spec["default"] for name, spec in properties.items() if "default" in spec}
    validate(job_variables, template["variables"], raise_on_error=True, preprocess=True, ignore_required=True)
    return apply_values(template["job_configuration"], {**defaults, **job_variables})


@pytest.mark.parametrize("kind", TEMPLATES)
def test_template_is_valid_and_keeps_every_setting_of_prefects_default(kind):
    template = _template(kind)
    WorkPoolCreate(name=f"gpu-{kind}", type=kind, base_job_template=template)  # the server's own check
    default = _default(kind)
    assert set(default["variables"]["properties"]) <= set(template["variables"]["properties"])
    assert set(default["job_configuration"]) <= set(template["job_configuration"])
    with pytest.raises(ValueError, match="undeclared variable"):
        broken = {**template, "job_configuration": {**template["job_configuration"], "extra": "{{ gpus }}"}}
        WorkPoolCreate(name="broken", type=kind, base_job_template=broken)


def test_kubernetes_job_claims_the_gpus_torchrun_uses(monkeypatch):
    job = _render(_template("kubernetes"), {"nproc_per_node": "4", "namespace": "training"})
    pod = job["job_manifest"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "4"
    assert {"name": "NPROC_PER_NODE", "value": "4"} in container["env"]
    assert container["image"] == "megatron-flow:gpu" and job["namespace"] == "training"
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    monkeypatch.setenv("NPROC_PER_NODE", container["env"][0]["value"])
    assert PretrainFlowConfig().processes_per_node() == 4
    with pytest.raises(ValidationError, match="does not match"):
        _render(_template("kubernetes"), {"nproc_per_node": "four"})


def test_docker_container_gets_every_gpu_and_the_process_count(monkeypatch):
    import docker.types

    job = _render(_template("docker"), {"env": {"NPROC_PER_NODE": "2"}})
    assert job["env"] == {"NPROC_PER_NODE": "2"} and job["image"] == "megatron-flow:gpu"
    # What the docker worker hands to docker's containers.create: a valid host configuration with the GPUs.
    host = docker.types.HostConfig(version="1.44", **job["container_create_kwargs"])
    assert host["DeviceRequests"] == [{"Driver": "nvidia", "Count": -1, "DeviceIDs": [], "Capabilities": [["gpu"]],
                                       "Options": {}}]  # fmt: skip
    assert host["ShmSize"] == 16 * 1024**3
    assert _render(_template("docker"), {})["env"] == {"NPROC_PER_NODE": "8"}
    monkeypatch.setenv("NPROC_PER_NODE", job["env"]["NPROC_PER_NODE"])
    assert PretrainFlowConfig().processes_per_node() == 2
