"""The corpus flow's settings and stage DAG without Prefect, and its command line (`make corpus`).

    python -m flows.corpus_plan                              # the embedded King James Bible, defaults
    python -m flows.corpus_plan --download.source 'data/*.jsonl.zst' --clean.min-words 20 --store s3://b/flow
    python -m flows.corpus_plan --task-runner dask --dask-address tcp://scheduler:8786 --store s3://b/flow
    python -m flows.corpus_plan --rebuild clean,tokenize          # build these again, and every stage after them
    python -m flows.corpus_plan --reuse-across-code-changes       # keep the artifacts built before a code change

The command line first asks the store whether every stage's artifact is committed (`committed_corpus`, the same
DAG walked with a look-up instead of a task): with nothing to do it prints the summary without importing Prefect
or starting a server, in about a second; otherwise it runs `flows.corpus.corpus_flow`. `python -m flows.corpus`
is the same command line with Prefect imported up front (docs/architecture.md). A stage's key covers its code:
after a code change the stages whose code changed and every stage after them run again, unless
`--reuse-across-code-changes` asks for the artifacts built by the earlier code (docs/architecture.md, "Rebuilding
and reusing artifacts").
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict

from flows.cli import parse_config
from flows.failures import StageFailed, command_line
from flows.summary import summarize, summary_table
from stages.clean import CleanParams
from stages.dedup import DedupParams
from stages.download import DownloadParams
from stages.registry import STAGE_MODULES, committed_ref
from stages.tokenize import TokenizeParams
from stages.train_tokenizer import TrainTokenizerParams
from storage.artifacts import ArtifactStore, CachePolicy

TaskRunnerKind = Literal["process", "thread", "dask", "ray"]
# The plural spellings the flags had before Dask and Ray were tested; configs and deployments may still use them.
_RUNNER_ALIASES = {"processes": "process", "threads": "thread"}


def runner_kind(value: Any) -> Any:
    """`--task-runner` as given, with the old plural spellings (processes, threads) read as the new ones."""
    return _RUNNER_ALIASES.get(value, value)


def rebuild_stages(value: Any) -> tuple[str, ...]:
    """`--rebuild` as given (`clean,tokenize`, or a list), each name checked against the stages there are."""
    names = (
        tuple(n.strip() for n in value.split(",") if n.strip()) if isinstance(value, str) else tuple(value)
    )
    unknown = [name for name in names if name not in STAGE_MODULES]
    if unknown:
        raise ValueError(f"unknown stage {', '.join(unknown)}; stages: {', '.join(STAGE_MODULES)}")
    return names


# Tokenizer types whose files the flow can train when none are given.
_TRAINABLE = {
    "GPT2BPETokenizer": "bpe",
    "BertWordPieceLowerCase": "wordpiece",
    "BertWordPieceCase": "wordpiece",
}


class CorpusConfig(BaseModel):
    """Everything the corpus flow does, with the defaults of `make corpus`."""

    model_config = ConfigDict(frozen=True)

    store: str = "./artifacts"
    download: DownloadParams = DownloadParams()
    clean: CleanParams = CleanParams()
    dedup: DedupParams = DedupParams()
    train_tokenizer: TrainTokenizerParams = TrainTokenizerParams(kind="bpe", vocab_size=8192)
    tokenize: TokenizeParams = TokenizeParams(append_eod=True, workers=2)
    task_runner: Annotated[TaskRunnerKind, BeforeValidator(runner_kind)] = "process"
    workers: int = 2
    dask_address: str | None = None  # a Dask scheduler to join (tcp://host:8786); None starts a local cluster
    ray_address: str | None = None  # a Ray cluster to join (ray://head:10001 or auto); None starts local Ray
    # Stages to build again although committed (a changed or damaged artifact), and with them every stage after.
    rebuild: Annotated[tuple[str, ...], BeforeValidator(rebuild_stages)] = ()
    # Take the artifacts built by earlier code for the same params and inputs instead of rebuilding after a change.
    reuse_across_code_changes: bool = False

    @property
    def cluster_address(self) -> str | None:
        """The address of the cluster the task runner joins (--dask-address or --ray-address)."""
        return {"dask": self.dask_address, "ray": self.ray_address}.get(self.task_runner)

    def forces(self, stage: str, inputs: list) -> bool:
        """Whether `stage` is built again although committed: `--rebuild` names it, or one of its inputs was
        rebuilt in this run (what follows a rebuilt stage is rebuilt too)."""
        return stage in self.rebuild or any(isinstance(i, dict) and i.get("rebuilt") for i in inputs)

    def store_for(self, rebuild: bool = False) -> ArtifactStore:
        """The store with this run's cache policy for one stage."""
        policy = CachePolicy(rebuild=rebuild, reuse_across_code_changes=self.reuse_across_code_changes)
        return ArtifactStore(self.store, policy)


def _needs_training(params: TokenizeParams) -> bool:
    return params.tokenizer_type in _TRAINABLE and params.vocab_file is None


def _tokenizer_files(tokenizer_ref: dict[str, Any], kind: str, store_url: str) -> dict[str, str]:
    """The trained tokenizer's files as the store names them (a path, or a URL every cluster worker reaches);
    the tokenize stage keys them by content and copies remote ones to each machine once."""
    ref = ArtifactStore(store_url).ref(tokenizer_ref)
    if kind == "bpe":
        return {"vocab_file": ref.file_url("vocab.json"), "merge_file": ref.file_url("merges.txt")}
    return {"vocab_file": ref.file_url("vocab.txt")}


RunStage = Callable[[str, dict[str, Any], list], dict[str, Any]]
StageCall = tuple[str, dict[str, Any], list]  # (stage, params, inputs): one call of a RunStage


def run_together(run: RunStage, calls: list[StageCall]) -> list[dict[str, Any]]:
    """The artifact references of stages that do not depend on each other: run at once where `run` can
    (`run.together`, the flows' task runner: `flows.tasks.FlowStageRunner`), else one after another (the store
    look-ups of `committed_stages`)."""
    together = getattr(run, "together", None)
    return together(calls) if together is not None else [run(*call) for call in calls]


def corpus_stages(config: CorpusConfig, run: RunStage) -> dict[str, dict[str, Any]]:
    """The corpus DAG, once: `run(stage, params, inputs)` gives each stage's artifact reference (a Prefect task
    in the flow, a look-up in the store for `committed_corpus`)."""
    store = config.store
    refs: dict[str, dict[str, Any]] = {}
    refs["download"] = run("download", dataclasses.asdict(config.download), [])
    refs["clean"] = run("clean", dataclasses.asdict(config.clean), [refs["download"]])
    refs["dedup"] = run("dedup", dataclasses.asdict(config.dedup), [refs["clean"]])
    tokenize = config.tokenize
    if _needs_training(tokenize):
        kind = _TRAINABLE[tokenize.tokenizer_type]
        train_params = config.train_tokenizer
        if kind != train_params.kind:  # the other kind's defaults (vocabulary size, special tokens)
            train_params = TrainTokenizerParams(kind=kind, text_key=train_params.text_key)
        refs["train_tokenizer"] = run("train_tokenizer", dataclasses.asdict(train_params), [refs["dedup"]])
        tokenize = dataclasses.replace(tokenize, **_tokenizer_files(refs["train_tokenizer"], kind, store))
    refs["tokenize"] = run("tokenize", dataclasses.asdict(tokenize), [refs["dedup"]])
    return refs


class _NotCommitted(Exception):
    """A stage of the corpus has work to do."""


def committed_stages(
    corpus: CorpusConfig, stages: Callable[[RunStage], dict[str, dict[str, Any]]]
) -> dict[str, dict[str, Any]] | None:
    """`stages(run)` with every stage looked up in the corpus config's store (all cache hits), or None when some
    stage has work to do (or `--rebuild` names it); decided from the store alone, so a command line with nothing
    to do needs no Prefect server."""

    store = corpus.store_for()

    def find(stage: str, params: dict[str, Any], inputs: list) -> dict[str, Any]:
        if corpus.forces(stage, inputs):
            raise _NotCommitted(stage)
        # A missing source or a changed tokenizer file: the stage's error, in one line.
        try:
            found = committed_ref(stage, params, inputs, store)[1]
        except Exception as error:
            raise StageFailed(stage, error) from error
        if found is None:
            raise _NotCommitted(stage)
        return found

    try:
        return stages(find)
    except _NotCommitted:
        return None


def committed_corpus(config: CorpusConfig) -> dict[str, dict[str, Any]] | None:
    """Every corpus stage's committed artifact, or None when some stage has work to do (`committed_stages`)."""
    return committed_stages(config, lambda run: corpus_stages(config, run))


def unused_rebuilds(corpus: CorpusConfig, refs: dict[str, dict[str, Any]], flow: str) -> list[str]:
    """Warnings for `--rebuild` names that are no stage of the flow that ran (nothing was rebuilt for them)."""
    return [
        f"warning: --rebuild {name}: the {flow} flow has no {name} stage (its stages: {', '.join(refs)})"
        for name in corpus.rebuild
        if name not in refs
    ]


@command_line
def main(argv: list[str] | None = None) -> int:
    config = parse_config(CorpusConfig, argv, description=__doc__.split("\n")[0])
    refs = committed_corpus(config)
    if refs is None:  # work to do: only now import Prefect and start (or connect to) a server
        from flows.corpus import run_corpus
        from flows.server import prefect_api

        ArtifactStore(config.store).check_writable()
        with prefect_api():
            refs = run_corpus(config)
    print(summary_table(summarize(refs, config.store)))
    print(f"tokens: {refs['tokenize']['url']}")
    for warning in unused_rebuilds(config, refs, "corpus"):
        print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    # `python -m flows.corpus_plan` runs this file as `__main__`: run the `flows.corpus_plan` module's `main`
    # instead, so the config it parses is the `CorpusConfig` class the corpus flow validates its parameter with.
    from flows.corpus_plan import main as corpus_main

    sys.exit(corpus_main())
