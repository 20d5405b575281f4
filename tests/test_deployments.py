"""`prefect.yaml`: every deployment resolves to its flow with valid parameters; the pipeline's trigger listens for
the event a corpus refresh emits on new token data, and only then is that event emitted."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prefect.cli.deploy._triggers import DeploymentTriggerAdapter
from prefect.events.schemas.events import Resource
from prefect.flows import load_flow_from_entrypoint

from flows.convert import ConvertFlowConfig
from flows.corpus import CorpusConfig
from flows.events import TOKENIZED_EVENT, announce_tokenized
from stages.convert import ConvertParams

ROOT = Path(__file__).resolve().parents[1]
# deployment -> (flow, the class of its `config` parameter, where in that config the artifact store is)
FLOWS = {
    "corpus-refresh": ("corpus", "CorpusConfig", ()),
    "pretrain": ("pretrain", "PretrainFlowConfig", ("corpus",)),
    "eval": ("eval", "EvalFlowConfig", ("pretrain", "corpus")),
    "convert": ("convert", "ConvertFlowConfig", ("pretrain", "corpus")),
    "pipeline": ("pipeline", "PipelineConfig", ("pretrain", "corpus")),
}
# Deployed with its flow's defaults.
RETRO = {"entrypoint": "flows/retro_flow.py:retro_flow", "work_pool": {"name": "local"}}


def _deployments() -> dict[str, dict]:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return {deployment["name"]: deployment for deployment in spec["deployments"]}


def test_every_deployment_resolves_to_its_flow_with_valid_parameters():
    deployments = _deployments()
    assert set(deployments) == {*FLOWS, "retro"}
    retro = deployments.pop("retro")
    assert retro["entrypoint"] == RETRO["entrypoint"] and retro["work_pool"]["name"] == "local"
    assert load_flow_from_entrypoint(str(ROOT / retro["entrypoint"])).name == "retro"
    for name, deployment in deployments.items():
        flow_name, config_class, corpus_path = FLOWS[name]
        flow = load_flow_from_entrypoint(str(ROOT / deployment["entrypoint"]))
        assert flow.name == flow_name
        config = flow.validate_parameters(deployment["parameters"])["config"]
        assert type(config).__name__ == config_class, name  # the entrypoint's own module: compare by name
        corpus = functools.reduce(getattr, corpus_path, config)
        assert corpus.store == "./artifacts", name  # every flow works on the refresh's store
        assert deployment["work_pool"]["job_variables"]["env"]["NPROC_PER_NODE"] == "2", name


def test_run_forms_need_no_input_and_type_every_setting():
    """The UI's run form comes from the flow's parameter schema: typed settings, none required."""
    for name, deployment in _deployments().items():
        schema = load_flow_from_entrypoint(str(ROOT / deployment["entrypoint"])).parameters.model_dump()
        assert not schema.get("required"), name
        for section, definition in schema["definitions"].items():
            assert not definition.get("required"), f"{name}: {section}"  # a default (or default factory) each
            for field, spec in definition["properties"].items():
                assert {"type", "anyOf", "$ref"} & set(spec), f"{name}: {section}.{field} has no type"
    pipeline = load_flow_from_entrypoint(
        str(ROOT / "flows/pipeline.py:pipeline_flow")
    ).parameters.model_dump()
    assert pipeline["definitions"]["ConvertParams"]["properties"]["saver"] == {
        "default": "hf", "title": "Saver", "type": "string",
    }  # fmt: skip


def test_corpus_refresh_keeps_its_nightly_schedule():
    deployment = _deployments()["corpus-refresh"]
    flow = load_flow_from_entrypoint(str(ROOT / deployment["entrypoint"]))
    CorpusConfig.model_validate(deployment["parameters"]["config"])
    runner = flow.to_deployment(
        name=deployment["name"], cron=deployment["schedules"][0]["cron"], parameters=deployment["parameters"]
    )
    assert runner.schedules[0].schedule.cron == "0 3 * * *"


def test_pipeline_trigger_fires_on_the_refresh_event_and_passes_its_key(monkeypatch):
    deployment = _deployments()["pipeline"]
    (spec,) = deployment["triggers"]
    trigger = DeploymentTriggerAdapter.validate_python({**spec, "name": "pipeline-on-new-data"})
    emitted: list[dict] = []
    monkeypatch.setattr("flows.events.emit_event", lambda **event: emitted.append(event) or event)
    ref = {"stage": "tokenize", "key": "0123abcd", "url": "/store/tokenize/0123abcd", "cache_hit": False}
    announce_tokenized(ref)
    (event,) = emitted
    assert event["event"] == TOKENIZED_EVENT and TOKENIZED_EVENT in trigger.expect
    assert trigger.match.includes([Resource(event["resource"])])
    assert not trigger.match.includes(
        [Resource({"prefect.resource.id": "megatron-flow.artifact.clean.0123abcd"})]
    )
    assert event["payload"]["key"] == "0123abcd" and event["payload"]["artifact"] == ref
    # The trigger's parameters (rendered from the event) are valid parameters of the pipeline flow.
    assert trigger.parameters == {"tokenize_key": "{{ event.payload.key }}"}
    flow = load_flow_from_entrypoint(str(ROOT / deployment["entrypoint"]))
    assert flow.validate_parameters({**deployment["parameters"], "tokenize_key": "0123abcd"})[
        "tokenize_key"
    ] == ("0123abcd")


def test_no_event_when_the_tokenize_stage_was_a_cache_hit(monkeypatch):
    emitted: list[dict] = []
    monkeypatch.setattr("flows.events.emit_event", lambda **event: emitted.append(event))
    assert (
        announce_tokenized({"stage": "tokenize", "key": "k", "url": "/s/tokenize/k", "cache_hit": True})
        is None
    )
    assert emitted == []


@pytest.mark.processes
def test_a_corpus_run_inside_another_flow_announces_nothing(prefect_api_url, monkeypatch):
    """A pipeline (or pretrain) run trains on the data its own corpus run built: announcing it would start a
    second pipeline run."""
    from prefect import flow

    emitted: list[dict] = []
    monkeypatch.setattr("flows.events.emit_event", lambda **event: emitted.append(event) or event)
    ref = {"stage": "tokenize", "key": "k", "url": "/s/tokenize/k", "cache_hit": False}

    @flow
    def refresh() -> dict | None:
        return announce_tokenized(ref)

    @flow
    def pipeline() -> dict | None:
        return refresh()

    assert pipeline() is None and emitted == []
    assert refresh()["payload"]["key"] == "k" and len(emitted) == 1


def test_pipeline_refuses_to_train_on_other_data_than_the_event_announced(monkeypatch):
    from flows import pipeline

    trained: list[ConvertFlowConfig] = []
    monkeypatch.setattr(
        pipeline, "corpus_flow", lambda config: {"tokenize": {"key": "ours", "url": "/s/t/ours"}}
    )
    monkeypatch.setattr(pipeline, "convert_flow", lambda config: trained.append(config) or {"convert": {}})
    monkeypatch.setattr(pipeline, "evaluate_run", lambda flow, refs, params, store: {**refs, "evaluate": {}})
    config = pipeline.PipelineConfig(convert=ConvertParams(saver="megatron"))
    with pytest.raises(ValueError, match=r"announced tokenize artifact theirs.*config\.pretrain\.corpus"):
        pipeline.pipeline_flow.fn(config, tokenize_key="theirs")
    assert trained == []
    assert pipeline.pipeline_flow.fn(config, tokenize_key="ours") == {"convert": {}, "evaluate": {}}
    assert trained == [ConvertFlowConfig(pretrain=config.pretrain, convert=ConvertParams(saver="megatron"))]


def test_the_pipelines_retro_branch_runs_on_the_pipelines_corpus(monkeypatch):
    from flows import pipeline
    from flows.pretrain import PretrainFlowConfig
    from flows.retro_flow import RetroFlowConfig

    branches: list[RetroFlowConfig] = []
    monkeypatch.setattr(pipeline, "convert_flow", lambda config: {"tokenize": {"key": "t"}, "convert": {}})
    monkeypatch.setattr(pipeline, "evaluate_run", lambda flow, refs, params, store: {**refs, "evaluate": {}})
    monkeypatch.setattr(
        pipeline,
        "retro_flow",
        lambda config: branches.append(config) or {"tokenize": {"key": "t"}, "retro_evaluate": {"key": "r"}},
    )
    corpus = CorpusConfig(store="/elsewhere")
    config = pipeline.PipelineConfig(pretrain=PretrainFlowConfig(corpus=corpus))
    assert "retro_evaluate" not in pipeline.pipeline_flow.fn(config) and branches == []
    retro = pipeline.PipelineConfig.model_validate(
        {"pretrain": {"corpus": {"store": "/elsewhere"}}, "retro": {"db": {"chunk_length": 32}}}
    )  # a deployment's JSON parameters
    refs = pipeline.pipeline_flow.fn(retro)
    assert set(refs) == {"tokenize", "convert", "evaluate", "retro_evaluate"}
    (branch,) = branches
    assert branch.corpus == corpus and branch.db.chunk_length == 32
    assert branch.query == RetroFlowConfig().query


def test_processes_per_node_come_from_the_config_else_the_work_pool_job_variable(monkeypatch):
    from flows.pretrain import PretrainFlowConfig, parse

    monkeypatch.delenv("NPROC_PER_NODE", raising=False)
    assert PretrainFlowConfig().processes_per_node() == 2
    monkeypatch.setenv("NPROC_PER_NODE", "8")  # what the pool's `env` job variable sets on the worker
    assert PretrainFlowConfig().processes_per_node() == 8
    assert PretrainFlowConfig(nproc_per_node=1).processes_per_node() == 1
    assert parse(["--nproc-per-node", "4"]).processes_per_node() == 4 and parse([]).processes_per_node() == 8


def test_convert_command_line_takes_the_format_and_megatron_flags():
    from flows.convert import parse
    from flows.pretrain import SMALL_GPT_ARGS

    config = parse(
        ["--store", "s3://b/flow", "--saver", "megatron", "--nproc-per-node", "1", "--", "--num-layers", "8"]
    )
    assert config.convert == ConvertParams(saver="megatron") and config.pretrain.corpus.store == "s3://b/flow"
    assert config.pretrain.megatron_args == (*SMALL_GPT_ARGS, "--num-layers", "8")
    assert parse([]).convert == ConvertParams() and parse([]).convert.saver == "hf"
    with pytest.raises(SystemExit):
        parse(["--saver", "flow"])  # the run's own format: argparse lists the choices


ENTRYPOINT_LOADER = """
import multiprocessing
import sys

from prefect.flows import load_flow_from_entrypoint


def import_packages():
    import flows, megatron_train, retro.project, stages, storage  # noqa: F401, E401


if __name__ == "__main__":
    for entrypoint in sys.argv[1:]:
        load_flow_from_entrypoint(entrypoint)
    import_packages()
    child = multiprocessing.get_context("spawn").Process(target=import_packages)  # a task runner's worker
    child.start()
    child.join()
    sys.exit(child.exitcode)
"""


@pytest.mark.processes
def test_a_worker_loads_every_deployment_by_file_without_shadowing_a_package(tmp_path):
    """A worker loads a deployment's file as a script, putting the file's folder first on sys.path, which the
    processes it spawns inherit: a flow file named like a package of ours (`flows/retro.py` once) shadows it."""
    script = tmp_path / "load_entrypoints.py"
    script.write_text(ENTRYPOINT_LOADER)
    entrypoints = [deployment["entrypoint"] for deployment in _deployments().values()]
    result = subprocess.run(
        [sys.executable, str(script), *entrypoints], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
