"""The corpus flow: download -> clean -> dedup -> (train tokenizer) -> tokenize, each a cached Prefect task.

    python -m flows.corpus                                   # the embedded King James Bible, defaults
    python -m flows.corpus --download.source 'data/*.jsonl.zst' --clean.min-words 20 --store s3://b/flow
    python -m flows.corpus --tokenize.vocab-file gpt2-vocab.json --tokenize.merge-file gpt2-merges.txt

Every stage's task uses the stage's fingerprint as Prefect cache key and passes artifact references, never
data; a rerun with nothing changed is all cache hits, a changed parameter reruns what depends on it, and a
killed run resumes from the committed shards. Without a vocabulary (`--tokenize.vocab-file`), a GPT-2-style
byte-level BPE is trained on the deduplicated corpus first.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from flows.cli import parse_config
from flows.server import prefect_api
from flows.summary import summarize, summary_table
from flows.tasks import TaskRunnerKind, make_task_runner, run_stage_task
from stages.clean import CleanParams
from stages.dedup import DedupParams
from stages.download import DownloadParams
from stages.tokenize import TokenizeParams
from stages.train_tokenizer import TrainTokenizerParams

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
    task_runner: TaskRunnerKind = "processes"
    workers: int = 2
    cluster_address: str | None = None


def _needs_training(params: TokenizeParams) -> bool:
    return params.tokenizer_type in _TRAINABLE and params.vocab_file is None


def _tokenizer_files(tokenizer_ref: dict[str, Any], kind: str, store_url: str) -> dict[str, str]:
    from storage.artifacts import ArtifactStore

    ref = ArtifactStore(store_url).ref(tokenizer_ref)
    if kind == "bpe":
        return {"vocab_file": ref.local_path("vocab.json"), "merge_file": ref.local_path("merges.txt")}
    return {"vocab_file": ref.local_path("vocab.txt")}


@flow(name="corpus")
def corpus_flow(config: CorpusConfig = CorpusConfig()) -> dict[str, Any]:
    """Raw text to Megatron `.bin`/`.idx` token data; returns each stage's artifact reference."""
    store = config.store
    refs: dict[str, dict[str, Any]] = {}
    refs["download"] = run_stage_task("download", dataclasses.asdict(config.download), [], store)
    refs["clean"] = run_stage_task("clean", dataclasses.asdict(config.clean), [refs["download"]], store)
    refs["dedup"] = run_stage_task("dedup", dataclasses.asdict(config.dedup), [refs["clean"]], store)
    tokenize = config.tokenize
    if _needs_training(tokenize):
        kind = _TRAINABLE[tokenize.tokenizer_type]
        train_params = config.train_tokenizer
        if kind != train_params.kind:  # the other kind's defaults (vocabulary size, special tokens)
            train_params = TrainTokenizerParams(kind=kind, text_key=train_params.text_key)
        refs["train_tokenizer"] = run_stage_task(
            "train_tokenizer", dataclasses.asdict(train_params), [refs["dedup"]], store
        )
        tokenize = dataclasses.replace(tokenize, **_tokenizer_files(refs["train_tokenizer"], kind, store))
    refs["tokenize"] = run_stage_task("tokenize", dataclasses.asdict(tokenize), [refs["dedup"]], store)
    get_run_logger().info("corpus summary\n%s", summary_table(summarize(refs, store)))
    return refs


def run_corpus(config: CorpusConfig) -> dict[str, Any]:
    """Run the flow on the task runner the config names (processes here, Dask or Ray on a cluster)."""
    runner = make_task_runner(config.task_runner, config.workers, config.cluster_address)
    return corpus_flow.with_options(task_runner=runner)(config)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(CorpusConfig, argv, description=__doc__.split("\n")[0])
    with prefect_api():
        refs = run_corpus(config)
    print(summary_table(summarize(refs, config.store)))
    print(f"tokens: {refs['tokenize']['url']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
