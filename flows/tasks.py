"""Prefect tasks around stages: the stage's fingerprint as cache key, artifact refs as results, retries.

A stage (`stages.base.Stage`, looked up by name with `stages.registry.stage_named`) has typed params, a `key` and a
`run`. The per-shard work of the stages that map shards (`Stage.maps_shards`) is handed to ``map_shards``: here
a function that maps a Prefect task over the shards on the flow's task runner (threads or processes on one
machine, a Dask or Ray cluster through prefect-dask / prefect-ray on many), so every shard is a task run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

from prefect import get_run_logger, task, unmapped
from prefect.context import TaskRunContext
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner

from flows.corpus_plan import CorpusConfig, RunStage, StageCall, TaskRunnerKind, runner_kind
from flows.failures import StageFailed
from flows.server import exit_with_parent
from stages.registry import committed_ref, input_refs, stage_named
from storage.artifacts import ArtifactStore, CachePolicy
from storage.fingerprint import hash_bytes

STAGE_LOGGER = "megatron_flow.stage"

# Errors that a retry can cure: network hiccups and object-store timeouts, not bad data or missing files.
_PERMANENT_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def make_task_runner(
    kind: TaskRunnerKind = "process", workers: int | None = None, address: str | None = None
) -> TaskRunner:
    """The task runner the per-shard work is mapped on. For Dask and Ray, `address` joins a running cluster
    (a scheduler `tcp://host:8786`, a Ray head `ray://host:10001` or `auto`); without one a local cluster of
    `workers` single-threaded worker processes (Dask) or CPUs (Ray) is started for the flow and stopped
    after it. Every worker must reach the flow's store (docs/architecture.md, "Clusters")."""
    kind = runner_kind(kind)
    if kind == "thread":
        return ThreadPoolTaskRunner(max_workers=workers)
    if kind == "process":  # workers stop when the flow process dies, even by SIGKILL
        return ProcessPoolTaskRunner(
            max_workers=workers, initializer=functools.partial(exit_with_parent, os.getpid())
        )
    if kind == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError as err:
            raise RuntimeError("--task-runner dask needs prefect-dask: pip install prefect-dask") from err
        if address:
            return DaskTaskRunner(address=address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": workers or 1, "threads_per_worker": 1})
    if kind == "ray":
        try:
            from prefect_ray import RayTaskRunner
        except ImportError as err:
            raise RuntimeError("--task-runner ray needs prefect-ray: pip install prefect-ray") from err
        if address:
            return RayTaskRunner(address=address)
        return RayTaskRunner(init_kwargs={"num_cpus": workers or 1})
    raise ValueError(f"unknown --task-runner {kind!r}: use process, thread, dask or ray")


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return isinstance(exc, OSError) and not isinstance(exc, _PERMANENT_OS_ERRORS)


def _retry_transient(task_: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - we only classify it
        return is_transient(exc)
    return False


@task(
    name="shard",
    task_run_name="{fn.__name__}",
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=_retry_transient,
)
def run_shard(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    """One shard of a stage's work, as a Prefect task run on the flow's task runner."""
    return fn(*args)


def prefect_map_shards(
    fn: Callable[..., Any], args_list: Sequence[tuple], on_result: Callable[[Any], None] | None = None
) -> list[Any]:
    """`map_shards` for stages inside a flow: one task run per shard, `on_result` as each finishes, results
    in order."""
    if not args_list:
        return []
    futures = run_shard.map(unmapped(fn), list(args_list))
    if on_result is not None:
        for future in as_completed(futures):
            on_result(future.result())
    return [future.result() for future in futures]


class _ToRunLogger(logging.Handler):
    """Forwards the stages' log records (tokenize summaries, training lines...) to the Prefect run's log."""

    def __init__(self, run_logger: logging.LoggerAdapter) -> None:
        super().__init__(logging.INFO)
        self.run_logger = run_logger

    def emit(self, record: logging.LogRecord) -> None:
        self.run_logger.log(record.levelno, record.getMessage())


@contextlib.contextmanager
def stage_logs_to_prefect() -> Iterator[None]:
    stage_logger = logging.getLogger(STAGE_LOGGER)
    handler = _ToRunLogger(get_run_logger())
    previous = stage_logger.level, stage_logger.propagate
    stage_logger.setLevel(logging.INFO)
    stage_logger.propagate = False  # the run logger prints them already
    stage_logger.addHandler(handler)
    try:
        yield
    finally:
        stage_logger.removeHandler(handler)
        stage_logger.level, stage_logger.propagate = previous


def _task_store(
    store_url: str, storage_options: dict[str, Any] | None, rebuild: bool, reuse_across_code_changes: bool
) -> ArtifactStore:
    """The store a stage task runs against, under the task's cache policy."""
    return ArtifactStore(
        store_url, CachePolicy(rebuild, reuse_across_code_changes), **(storage_options or {})
    )


def _stage_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """Prefect's cache key: the stage's own fingerprint in this store, known before the stage runs, so the first
    run's result is recorded under the key a rerun looks up and the rerun is Cached (with
    `reuse_across_code_changes`, the key of the artifact found for the same params and inputs). The store is part
    of it: the same stage in another store is another artifact (another URL). While the artifact is not committed
    (never built, or deleted from the store), a Prefect record under that key is stale: it is expired here, so
    the task runs and rebuilds instead of returning a reference to nothing. A rebuild runs with Prefect's
    `refresh_cache` (`stage_ref`)."""
    store = _task_store(
        parameters["store_url"],
        parameters.get("storage_options"),
        False,
        parameters.get("reuse_across_code_changes", False),
    )
    key, found = committed_ref(parameters["stage"], parameters["params"], parameters["inputs"], store)
    cache_key = f"{parameters['stage']}-{key}-{hash_bytes(store.url.encode())[:16]}"
    if found is None and context.result_store.exists(cache_key):
        context.result_store.write(None, key=cache_key, expiration=datetime.now(timezone.utc))
    return cache_key


@task(
    name="stage",
    task_run_name="{stage}",
    cache_key_fn=_stage_cache_key,
    persist_result=True,
    result_serializer="json",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=_retry_transient,
)
def run_stage_task(
    stage: str,
    params: dict[str, Any],
    inputs: list[dict | str],
    store_url: str,
    storage_options: dict[str, Any] | None = None,
    rebuild: bool = False,
    reuse_across_code_changes: bool = False,
) -> dict[str, Any]:
    """Run one stage; returns its ArtifactRef as a plain dict (small, JSON-serialisable). `rebuild`: discard the
    committed artifact and build it again; `reuse_across_code_changes`: an artifact built by other code for the
    same params and inputs counts as committed."""
    runner = stage_named(stage)
    store = _task_store(store_url, storage_options, rebuild, reuse_across_code_changes)
    typed, refs = runner.params_from_dict(params), input_refs(store, inputs)
    with stage_logs_to_prefect():
        if runner.maps_shards:
            ref = runner.run(typed, refs, store, map_shards=prefect_map_shards)
        else:
            ref = runner.run(typed, refs, store)
    return ref.to_dict()


def _stage_call(stage: str, inputs: list[dict | str], corpus: CorpusConfig) -> tuple[Any, dict[str, Any]]:
    """`run_stage_task` as the corpus config runs `stage` (Prefect's cache refreshed when `--rebuild` names it or
    an input was rebuilt), and its keyword arguments."""
    rebuild = corpus.forces(stage, inputs)
    task_ = run_stage_task.with_options(refresh_cache=rebuild) if rebuild else run_stage_task
    return task_, {"rebuild": rebuild, "reuse_across_code_changes": corpus.reuse_across_code_changes}


def _stage_result(stage: str, state: Any) -> dict[str, Any]:
    """The artifact reference of a finished stage task's state; `StageFailed` for a failed one."""
    try:
        ref = state.result()
    except Exception as error:
        raise StageFailed(stage, error) from error
    return {**ref, "cache_hit": ref["cache_hit"] or state.name == "Cached"}


def stage_ref(
    stage: str, params: dict[str, Any], inputs: list[dict | str], corpus: CorpusConfig
) -> dict[str, Any]:
    """`run_stage_task`'s artifact reference in the corpus config's store, with `cache_hit` true when nothing was
    built: the stage found its artifact, or Prefect returned the recorded result (Cached state), which holds the
    first run's `cache_hit`. A stage `--rebuild` names, or whose input was rebuilt, is built again (Prefect's
    record refreshed). A failed stage raises `StageFailed` (its name and error in one line)."""
    task_, options = _stage_call(stage, inputs, corpus)
    return _stage_result(stage, task_(stage, params, inputs, corpus.store, **options, return_state=True))


def stage_refs_together(calls: list[StageCall], corpus: CorpusConfig) -> list[dict[str, Any]]:
    """`stage_ref` of stages that do not depend on each other, run at once on the flow's task runner; every one
    finishes before the first failure is raised, so none is left running."""
    futures = []
    for stage, params, inputs in calls:
        task_, options = _stage_call(stage, inputs, corpus)
        futures.append((stage, task_.submit(stage, params, inputs, corpus.store, **options)))
    for _, future in futures:
        future.wait()
    return [_stage_result(stage, future.state) for stage, future in futures]


class FlowStageRunner:
    """`run(stage, params, inputs)` for a flow's DAG, each stage a Prefect task in the corpus config's store;
    `run.together(calls)` runs independent stages at once (`flows.corpus_plan.run_together`)."""

    def __init__(self, corpus: CorpusConfig) -> None:
        self.corpus = corpus

    def __call__(self, stage: str, params: dict[str, Any], inputs: list[dict | str]) -> dict[str, Any]:
        return stage_ref(stage, params, inputs, self.corpus)

    def together(self, calls: list[StageCall]) -> list[dict[str, Any]]:
        return stage_refs_together(calls, self.corpus)


def stage_runner(corpus: CorpusConfig) -> RunStage:
    """`run(stage, params, inputs)` for a flow's DAG: each stage a Prefect task in the corpus config's store."""
    return FlowStageRunner(corpus)
