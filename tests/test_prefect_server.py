"""The deployments as a user runs them: a real `prefect server start`, a process worker, `prefect deploy --all` of
`prefect.yaml`, then `prefect deployment run` (the refresh runs through the same REST call, saving a process
start each). The pipeline completes end to end (corpus -> pretrain -> convert ->
evaluate) with its summary table and evaluation report in Prefect; an unchanged refresh is all Cached and triggers
nothing; a refresh of a changed source fires the pipeline's trigger, which trains on the announced data. Then the
refresh gets a schedule seconds apart: the server's scheduler creates a run and the worker executes it. The
server's log holds no error from its services (with SQLAlchemy 2.1 the scheduler failed on every loop: "Can't
evaluate bulk DML statement").

One test, since the server, the worker and each flow run's process take most of its time (about 3 minutes on 2
cores, twice that when the machine is heavily shared); the deployments' parameters are `prefect.yaml`'s with a
small corpus and a tiny GPT.
"""

from __future__ import annotations

import json
import lzma
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from flows.events import TOKENIZED_EVENT
from stages.download import EMBEDDED_CORPUS
from tests.helpers.distributed import free_port
from tests.helpers.readiness import wait_until_ready

ROOT = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
TINY_GPT = (
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "4", "--global-batch-size", "4",
    "--train-iters", "6", "--lr", "1e-3", "--split", "90,10,0", "--eval-interval", "6", "--eval-iters", "1",
    "--log-interval", "2", "--seed", "3",
)  # fmt: skip

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.processes]


def _chapters(source: Path, count: int) -> None:
    with lzma.open(EMBEDDED_CORPUS, "rt") as f, open(source, "w") as out:
        out.writelines(line for _, line in zip(range(count), f, strict=False))


def _deployment_file(tmp_path: Path, corpus: dict) -> Path:
    """`prefect.yaml` with the small corpus and the tiny GPT in every deployment's parameters."""
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    tiny = {"corpus": corpus, "megatron_args": list(TINY_GPT), "nproc_per_node": 1, "save_interval": 6}
    evaluate = {"prompts": ["In the beginning"], "tokens_to_generate": 4, "max_validation_samples": 4}
    parameters = {
        "corpus-refresh": {"config": corpus},
        "pretrain": {"config": tiny},
        "eval": {"config": {"pretrain": tiny, "evaluate": evaluate}},
        "convert": {"config": {"pretrain": tiny}},
        "pipeline": {"config": {"pretrain": tiny, "evaluate": evaluate}},
    }
    spec["deployments"] = [
        {**d, "parameters": parameters.get(d["name"], d.get("parameters", {}))} for d in spec["deployments"]
    ]
    path = tmp_path / "prefect.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[dict[str, str]]:
    """`prefect server start` on a free port with a Prefect home of its own; yields the environment for clients."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "0",  # a scheduled run starts when due, not before
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MEGATRON_FLOW_HOME": str(ROOT),
        "PREFECT_CLI_PROMPT": "false",
    }
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_until_ready(
            lambda: httpx.get(f"{env['PREFECT_API_URL']}/health", timeout=10).status_code == 200,
            "prefect server start",
            process=server,
            output=lambda: (tmp_path / "server.log").read_text()[-3000:],
        )
        yield env
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def _prefect(env: dict[str, str], *args: str, timeout: float = 240) -> str:
    done = subprocess.run(
        [*PREFECT, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def _api(env: dict[str, str], method: str, path: str, body: dict | None = None) -> list | dict:
    """One REST call, retried on 503 as Prefect's own client does: its server answers 503 when SQLite is busy
    (the worker and the flow runs write at the same time), having rolled the request's transaction back."""
    for attempt in range(8):
        response = httpx.request(method, f"{env['PREFECT_API_URL']}{path}", json=body, timeout=30)
        if response.status_code != 503:
            break
        time.sleep(0.5 * 2**attempt)
    response.raise_for_status()
    return response.json() if response.content else {}


def _runs(env: dict[str, str], flow_name: str) -> list[dict]:
    """Top-level flow runs of `flow_name`'s deployments, oldest first."""
    runs = _api(env, "POST", "/flow_runs/filter", {
        "flows": {"name": {"any_": [flow_name]}}, "flow_runs": {"parent_task_run_id": {"is_null_": True}},
        "sort": "EXPECTED_START_TIME_ASC",
    })  # fmt: skip
    return [run for run in runs if run["deployment_id"]]


def _artifacts(env: dict[str, str], flow_run_id: str) -> dict[str, dict]:
    found = _api(env, "POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    return {artifact["key"]: artifact for artifact in found}


def _stage_states(env: dict[str, str], flow_run_id: str) -> dict[str, str]:
    tasks = _api(env, "POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    return {t["name"]: t["state"]["name"] for t in tasks if t["task_key"].startswith("run_stage_task")}


def _run_deployment(env: dict[str, str], name: str) -> dict:
    """`prefect deployment run NAME --watch`: the flow run once it finished, asserted Completed."""
    out = _prefect(
        env, "deployment", "run", name, "--watch", "--watch-interval", "1", "--watch-timeout", "200"
    )
    run = _api(env, "GET", f"/flow_runs/{re.search(r'UUID: ([0-9a-f-]{36})', out).group(1)}")
    assert run["state"]["type"] == "COMPLETED", out[-3000:]
    return run


def _create_pool(env: dict[str, str], name: str) -> None:
    """What `prefect work-pool create NAME --type process` does, without starting one more process."""
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    _api(env, "POST", "/work_pools/", {"name": name, "type": "process", "base_job_template": template})


def _run_refresh(env: dict[str, str]) -> dict:
    """A run of the refresh deployment through the REST API (as `prefect deployment run` does), once finished."""
    deployment = _api(env, "GET", "/deployments/name/corpus/corpus-refresh")
    run = _api(env, "POST", f"/deployments/{deployment['id']}/create_flow_run", {})
    deadline = time.monotonic() + 200
    while run["state"]["type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
        assert time.monotonic() < deadline, (
            f"the refresh run {run['id']} did not finish in 200 s: {run['state']}"
        )
        time.sleep(0.5)
        run = _api(env, "GET", f"/flow_runs/{run['id']}")
    assert run["state"]["type"] == "COMPLETED", run["state"]
    return run


def _wait_for(env: dict[str, str], flow_name: str, count: int, timeout: float) -> list[dict]:
    """The flow's deployment runs once there are `count` and all are finished."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = _runs(env, flow_name)
        if len(runs) >= count and all(r["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED") for r in runs):
            return runs
        time.sleep(1)
    raise AssertionError(f"{flow_name}: expected {count} finished runs, got {_runs(env, flow_name)}")


def test_deployments_on_a_real_server_and_worker_run_trigger_and_cache(prefect_server, tmp_path):
    env = prefect_server
    source = tmp_path / "source.jsonl"
    _chapters(source, 24)
    corpus = {
        "store": str(tmp_path / "store"),
        "download": {"source": str(source), "docs_per_shard": 12},
        "train_tokenizer": {"kind": "bpe", "vocab_size": 512},
        "tokenize": {"append_eod": True, "workers": 1},
        "task_runner": "thread",  # the deployment schema holds the new names only (the aliases are Python-side)
    }
    _create_pool(env, "local")
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen(
            [*PREFECT, "worker", "start", "--pool", "local", "--type", "process"],
            env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            # Prefect infers a version from git and sends the origin's URL, which its server rejects (422) when
            # the checkout was cloned from a local path (as CI clones): deploy without git's view of the clone.
            no_git = {**env, "GIT_DIR": str(tmp_path / "no-git")}
            deployed = _prefect(
                no_git, "deploy", "--all", "--prefect-file", str(_deployment_file(tmp_path, corpus))
            )
            for name in ("corpus/corpus-refresh", "pretrain/pretrain", "eval/eval", "convert/convert",
                         "pipeline/pipeline"):  # fmt: skip
                assert name in deployed, deployed
            _scenario(env, tmp_path, source)
            _scheduled_refresh(env)
        except BaseException:
            print((tmp_path / "worker.log").read_text()[-8000:])
            raise
        finally:
            worker.terminate()
            try:
                worker.wait(60)
            except subprocess.TimeoutExpired:  # a busy machine: its shutdown is not what this test checks
                worker.kill()
                worker.wait(30)
    # The services (the scheduler among them) run as docket tasks: an error of theirs is a line of either logger.
    errors = [
        line
        for line in (tmp_path / "server.log").read_text().splitlines()
        if re.search(r"\| ERROR +\| (prefect\.server\.services|docket)", line)
    ]
    assert not errors, "Prefect's services logged errors:\n" + "\n".join(errors[:20])


def _scenario(env: dict[str, str], tmp_path: Path, source: Path) -> None:
    # The pipeline end to end, started as a user would; its table and report are in Prefect.
    pipeline = _run_deployment(env, "pipeline/pipeline")
    published = _artifacts(env, pipeline["id"])
    table = json.loads(published["pipeline-summary"]["data"])
    assert published["pipeline-summary"]["type"] == "table"
    assert [row["stage"] for row in table] == [
        "download", "clean", "dedup", "train_tokenizer", "tokenize", "pretrain", "convert", "evaluate",
    ]  # fmt: skip
    report = published["evaluation-report"]
    assert report["type"] == "markdown" and "| held-out loss (whole validation split) |" in report["data"]
    assert "[Loss curves (PNG)](file://" in report["data"]
    converted = tmp_path / "store" / "convert"
    (folder,) = converted.iterdir()
    link = published["convert-artifact"]["data"]  # every stage's artifact, as a link
    assert link == f"[{folder}]({folder.as_uri()})"
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt", "manifest.json"} <= {
        p.name for p in folder.iterdir()
    }

    # An unchanged source: the refresh's stages are Prefect's Cached on this first rerun, and nothing is announced.
    refresh = _run_refresh(env)
    stages = ["download", "clean", "dedup", "train_tokenizer", "tokenize"]
    assert _stage_states(env, refresh["id"]) == dict.fromkeys(stages, "Cached")

    # A changed source: new token data, announced; the trigger starts the pipeline on exactly that data.
    _chapters(source, 30)
    _run_refresh(env)
    runs = _wait_for(env, "pipeline", 2, timeout=240)
    events = _api(env, "POST", "/events/filter", {"filter": {"event": {"name": [TOKENIZED_EVENT]}}})["events"]
    assert len(events) == 1, (
        events
    )  # the pipeline's own corpus run and the unchanged refresh announced nothing
    new_key = events[0]["payload"]["key"]
    assert len(runs) == 2 and runs[1]["parameters"]["tokenize_key"] == new_key
    assert runs[1]["state"]["type"] == "COMPLETED", runs[1]["state"]
    assert (tmp_path / "store" / "tokenize" / new_key / "manifest.json").exists()
    assert len(list(converted.iterdir())) == 2  # the new data's model was converted as well


def _scheduled_refresh(env: dict[str, str]) -> None:
    """The refresh deployment with a schedule every 10 s: the scheduler creates runs, the worker executes the first
    (all Cached: the source is unchanged); the schedule is then removed, with the runs it had not started."""
    deployment = _api(env, "GET", "/deployments/name/corpus/corpus-refresh")
    (schedule,) = _api(env, "POST", f"/deployments/{deployment['id']}/schedules", [
        {"schedule": {"interval": 10.0}, "active": True},
    ])  # fmt: skip
    deadline = time.monotonic() + 240
    try:
        while True:
            runs = [
                r
                for r in _runs(env, "corpus")
                if r["auto_scheduled"] and r["deployment_id"] == deployment["id"]
            ]
            if any(r["state"]["type"] == "COMPLETED" for r in runs):
                break
            failed = [r["state"] for r in runs if r["state"]["type"] in ("FAILED", "CRASHED")]
            assert not failed, failed
            assert time.monotonic() < deadline, (
                f"no scheduled refresh completed in 240 s: {[r['state'] for r in runs]}"
            )
            time.sleep(1)
    finally:
        _api(env, "DELETE", f"/deployments/{deployment['id']}/schedules/{schedule['id']}")
    done = next(r for r in runs if r["state"]["type"] == "COMPLETED")
    states = _stage_states(env, done["id"])
    assert states == dict.fromkeys(["download", "clean", "dedup", "train_tokenizer", "tokenize"], "Cached")
