"""The corpus flow: download -> clean -> dedup -> (train tokenizer) -> tokenize, each a cached Prefect task.

    python -m flows.corpus                                   # the embedded King James Bible, defaults
    python -m flows.corpus --download.source 'data/*.jsonl.zst' --clean.min-words 20 --store s3://b/flow
    python -m flows.corpus --tokenize.vocab-file gpt2-vocab.json --tokenize.merge-file gpt2-merges.txt
    python -m flows.corpus --task-runner dask --dask-address tcp://scheduler:8786 --store s3://b/flow

Every stage's task uses the stage's fingerprint as Prefect cache key and passes artifact references, never
data; a rerun with nothing changed is all cache hits, a changed parameter reruns what depends on it, and a
killed run resumes from the committed shards. Without a vocabulary (`--tokenize.vocab-file`), a GPT-2-style
byte-level BPE is trained on the deduplicated corpus first. The command line decides from the store whether
anything is to do before it starts a Prefect server; the flow publishes its summary and artifact links to the
Prefect UI and announces new token data with a Prefect event (`flows.events`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Annotated, Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, BeforeValidator, ConfigDict

from flows.cli import parse_config
from flows.events import announce_tokenized
from flows.publish import publish_stages
from flows.server import prefect_api
from flows.summary import summarize, summary_table
from flows.tasks import TaskRunnerKind, committed_ref, make_task_runner, runner_kind, stage_ref
from stages.clean import CleanParams
from stages.dedup import DedupParams
from stages.download import DownloadParams
from stages.tokenize import TokenizeParams
from stages.train_tokenizer import TrainTokenizerParams
from storage.artifacts import ArtifactStore

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

    @property
    def cluster_address(self) -> str | None:
        """The address of the cluster the task runner joins (--dask-address or --ray-address)."""
        return {"dask": self.dask_address, "ray": self.ray_address}.get(self.task_runner)


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


def committed_corpus(config: CorpusConfig) -> dict[str, dict[str, Any]] | None:
    """Every stage's committed artifact (all cache hits), or None when some stage has work to do; decided from
    the store alone, so a command line with nothing to do needs no Prefect server."""

    store = ArtifactStore(config.store)

    def find(stage: str, params: dict[str, Any], inputs: list) -> dict[str, Any]:
        found = committed_ref(stage, params, inputs, store)[1]
        if found is None:
            raise _NotCommitted(stage)
        return found

    try:
        return corpus_stages(config, find)
    except _NotCommitted:
        return None


@flow(name="corpus")
def corpus_flow(config: CorpusConfig = CorpusConfig()) -> dict[str, Any]:
    """Raw text to Megatron `.bin`/`.idx` token data; returns each stage's artifact reference."""
    refs = corpus_stages(config, lambda stage, params, inputs: stage_ref(stage, params, inputs, config.store))
    get_run_logger().info("corpus summary\n%s", summary_table(summarize(refs, config.store)))
    publish_stages("corpus", refs, config.store)
    announce_tokenized(refs["tokenize"])
    return refs


def run_corpus(config: CorpusConfig) -> dict[str, Any]:
    """Run the flow on the task runner the config names (processes here, Dask or Ray on a cluster)."""
    runner = make_task_runner(config.task_runner, config.workers, config.cluster_address)
    return corpus_flow.with_options(task_runner=runner)(config)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(CorpusConfig, argv, description=__doc__.split("\n")[0])
    refs = committed_corpus(config)
    if refs is None:  # work to do: only now start (or connect to) a Prefect server
        with prefect_api():
            refs = run_corpus(config)
    print(summary_table(summarize(refs, config.store)))
    print(f"tokens: {refs['tokenize']['url']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
