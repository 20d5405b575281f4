"""The corpus flow: download -> clean -> dedup -> (train tokenizer) -> tokenize, each a cached Prefect task.

    python -m flows.corpus                                   # the embedded King James Bible, defaults
    python -m flows.corpus --download.source 'data/*.jsonl.zst' --clean.min-words 20 --store s3://b/flow
    python -m flows.corpus --tokenize.vocab-file gpt2-vocab.json --tokenize.merge-file gpt2-merges.txt

Every stage's task uses the stage's fingerprint as Prefect cache key and passes artifact references, never
data; a rerun with nothing changed is all cache hits, a changed parameter reruns what depends on it, and a
killed run resumes from the committed shards. Without a vocabulary (`--tokenize.vocab-file`), a GPT-2-style
byte-level BPE is trained on the deduplicated corpus first. The settings, the DAG and the command line live in
`flows.corpus_plan` (no Prefect import: a command line with nothing to do returns at once); the flow publishes
its summary and artifact links to the Prefect UI and announces new token data with a Prefect event
(`flows.events`).
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, get_run_logger

from flows.corpus_plan import CorpusConfig, corpus_stages, main
from flows.events import announce_tokenized
from flows.publish import publish_stages
from flows.summary import summarize, summary_table
from flows.tasks import make_task_runner, stage_runner

__all__ = ["CorpusConfig", "corpus_flow", "corpus_stages", "main", "run_corpus"]


@flow(name="corpus")
def corpus_flow(config: CorpusConfig = CorpusConfig()) -> dict[str, Any]:
    """Raw text to Megatron `.bin`/`.idx` token data; returns each stage's artifact reference."""
    refs = corpus_stages(config, stage_runner(config))
    get_run_logger().info("corpus summary\n%s", summary_table(summarize(refs, config.store)))
    publish_stages("corpus", refs, config.store)
    announce_tokenized(refs["tokenize"])
    return refs


def run_corpus(config: CorpusConfig) -> dict[str, Any]:
    """Run the flow on the task runner the config names (processes here, Dask or Ray on a cluster)."""
    runner = make_task_runner(config.task_runner, config.workers, config.cluster_address)
    return corpus_flow.with_options(task_runner=runner)(config)


if __name__ == "__main__":
    sys.exit(main())
