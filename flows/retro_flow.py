"""The Retro flow: corpus -> embedder -> chunk database -> embed -> index train -> index add -> query neighbours
(the Retro project directory, `retro.project`) -> Retro pretraining and its GPT baseline (same decoder, steps and
samples) -> the comparison report with the database update (`stages.retro_evaluate`), each a cached Prefect
task. The command line prints both validation perplexities and the database update's before/after.

    python -m flows.retro_flow                                  # the embedded corpus, MiniLM's first layer, defaults
    python -m flows.retro_flow --embedder.num-layers None --query.nprobe 64 --corpus.store s3://bucket/flow

`retro_data_stages` builds the project, `retro_model_stages` trains and compares on it. The
GPT tokenizer of the Retro stages is the corpus's (its trained or given files); the embedder is the
`retro_embedder` artifact. A rerun with nothing changed is all cache hits; the command line decides that from the
store and then starts no Prefect server. See docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict

from flows.cli import parse_config
from flows.corpus_plan import (
    CorpusConfig,
    RunStage,
    committed_stages,
    corpus_stages,
    run_together,
    unused_rebuilds,
)
from flows.failures import command_line
from flows.publish import publish_report, publish_stages
from flows.server import prefect_api
from flows.summary import summarize, summary_table
from flows.tasks import make_task_runner, stage_runner
from stages.clean import CleanParams
from stages.dedup import DedupParams
from stages.download import EMBEDDED_CORPUS, DownloadParams
from stages.retro_evaluate import RetroEvaluateParams
from stages.retro_params import (
    DbParams,
    EmbedderParams,
    EmbedParams,
    IndexAddParams,
    IndexTrainParams,
    QueryParams,
    local_dir,
)
from stages.retro_pretrain import RetroPretrainParams
from storage.artifacts import ArtifactStore

STDLIB_CORPUS = str(Path(EMBEDDED_CORPUS).with_name("stdlib.jsonl.xz"))  # beside the KJV: stages/corpora


# The recipe: the retro_pretrain stage's default flags (init std 0.1, rotary positions, no dropout: why there), then
# the steps from the GPT's checkpoint and what Retro adds (README, Retro flow: each lever's measurement).
RETRO_STEPS = 1000  # Retro retro-fitted from the GPT's 120, and the GPT baseline continued as long
# Training samples queried as held-out documents (their near-duplicates' chunks excluded): the validation modules
# have no other release in the database, and a model that never met useless neighbours copies them.
HELD_OUT_SHARE = 0.2
RECIPE_RETRO_FLAGS = (
    "--retro-num-neighbors", "1", "--retro-encoder-layers", "3", "--retro-encoder-hidden-dropout", "0",
    "--retro-encoder-attention-dropout", "0",
)  # fmt: skip


class RetroFlowConfig(BaseModel):
    """Everything the Retro flow does, with the defaults of `make retro`: the standard-library corpus
    (`stages/corpora/stdlib.jsonl.xz`) cleaned as code and deduplicated exactly, 16-token chunks, all-MiniLM-L6-v2
    cut to its first layer, an IVF index of 128 lists searched with nprobe 16, and the samples of a 256-token,
    1,000-iteration run of global batch 8 evaluated every 100 iterations (the samples the Retro run reads; the GPT
    it is retro-fitted from reads the first 960: no neighbours are queried for samples no run reads), 20% of the
    training samples queried as held-out documents (no neighbour from a near-duplicate of their own documents, as
    for the validation modules). The `query`
    section is the Retro pretraining run's data settings (sequence length, split, seed, samples, evaluation,
    global batch): they go to the project's config.json, which `pretrain_retro` takes them from. The database
    holds the train documents of `query.split` (Megatron's one `--retro-gpt-split`; `db.split` is set from it).
    `pretrain` is the GPT's decoder and optimizer (`flags`), the steps of the runs started from its checkpoint
    (`fit_flags`) and what the Retro run adds (`retro_flags`); with `retro_fit` the Retro run starts from the GPT
    run's checkpoint (Megatron's retro-fitting) and is compared with the GPT continued as long, else it starts
    from scratch on the same flags and is compared with the GPT."""

    model_config = ConfigDict(frozen=True)

    corpus: CorpusConfig = CorpusConfig(
        download=DownloadParams(source=STDLIB_CORPUS),
        clean=CleanParams.code(),
        # exact copies out; near-copies are what Retro reads (README, Retro flow)
        dedup=DedupParams(near=False),
    )
    embedder: EmbedderParams = EmbedderParams(num_layers=1)
    db: DbParams = DbParams(chunk_length=16)
    embed: EmbedParams = EmbedParams(block_size=2000, workers=2)
    index_train: IndexTrainParams = IndexTrainParams(index_str="IVF128,Flat", ntrain=8000)
    index_add: IndexAddParams = IndexAddParams(workers=2)
    query: QueryParams = (
        QueryParams(  # the samples the Retro run reads: 1,000 steps of 8, evaluated every 100
            seq_length=256,
            split="95,5,0",
            train_samples=RETRO_STEPS * 8,
            eval_interval=100,
            eval_iters=5,
            global_batch_size=8,
            nprobe=16,
            num_neighbors_query=60,
            num_neighbors_save=2,
            block_size=2000,
            held_out_share=HELD_OUT_SHARE,
        )
    )
    pretrain: RetroPretrainParams = RetroPretrainParams(
        fit_flags=("--train-iters", str(RETRO_STEPS)), retro_flags=RECIPE_RETRO_FLAGS
    )
    retro_fit: bool = True
    evaluate: RetroEvaluateParams = RetroEvaluateParams(validation_samples=64)


def _store_ref(ref: dict[str, Any], store_url: str) -> Any:
    return ArtifactStore(store_url).ref(ref)


def gpt_tokenizer_fields(config: RetroFlowConfig, refs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The corpus's GPT tokenizer as the Retro stages' `gpt_*` params: its trained files, or the given ones."""
    tokenize = config.corpus.tokenize
    fields = {
        "gpt_tokenizer_type": tokenize.tokenizer_type,
        "gpt_vocab_file": tokenize.vocab_file,
        "gpt_merge_file": tokenize.merge_file,
        "gpt_tokenizer_model": tokenize.tokenizer_model,
    }
    if "train_tokenizer" in refs:
        trained = _store_ref(refs["train_tokenizer"], config.corpus.store)
        fields |= {
            "gpt_vocab_file": trained.local_path("vocab.json"),
            "gpt_merge_file": trained.local_path("merges.txt"),
        }
    return fields


def retro_data_stages(
    config: RetroFlowConfig, refs: dict[str, dict[str, Any]], run: RunStage
) -> dict[str, dict[str, Any]]:
    """The Retro data steps after the corpus, once: `run(stage, params, inputs)` gives each stage's artifact
    reference (a Prefect task in the flow, a look-up in the store for `committed_retro`)."""
    refs = dict(refs)
    refs["retro_embedder"] = run("retro_embedder", dataclasses.asdict(config.embedder), [])
    embedder = local_dir(_store_ref(refs["retro_embedder"], config.corpus.store))
    shared = {**gpt_tokenizer_fields(config, refs), "embedder": embedder}

    def params(section: Any, **overrides: Any) -> dict[str, Any]:
        return dataclasses.asdict(dataclasses.replace(section, **shared, **overrides))

    tokenize = refs["tokenize"]
    refs["retro_db"] = run("retro_db", params(config.db, split=config.query.split), [tokenize])
    refs["retro_embed"] = run(  # as many embedding processes as the task runner runs at once
        "retro_embed", params(config.embed, workers=config.corpus.workers), [tokenize, refs["retro_db"]]
    )
    refs["retro_index_train"] = run(
        "retro_index_train", dataclasses.asdict(config.index_train), [refs["retro_db"], refs["retro_embed"]]
    )
    refs["retro_index_add"] = run(
        "retro_index_add",
        dataclasses.asdict(config.index_add),
        [refs["retro_embed"], refs["retro_index_train"]],
    )
    refs["retro_query"] = run(
        "retro_query",
        params(config.query),
        [tokenize, refs["retro_db"], refs["retro_index_add"]],
    )
    return refs


def retro_model_stages(
    config: RetroFlowConfig, refs: dict[str, dict[str, Any]], run: RunStage
) -> dict[str, dict[str, Any]]:
    """Retro pretraining and its GPT baseline on the project, then the report comparing them. Retro-fitted, the
    Retro run starts from the GPT run's checkpoint, and so does the baseline it is compared with: the GPT
    continued as many steps on the same samples (`gpt_baseline`)."""
    refs = dict(refs)
    query = refs["retro_query"]
    gpt = dataclasses.replace(config.pretrain, retriever=False, fit_flags=(), retro_flags=())
    refs["gpt_pretrain"] = run("retro_pretrain", dataclasses.asdict(gpt), [query])
    retro = dataclasses.replace(config.pretrain, retriever=True)
    if config.retro_fit:  # the two runs from the GPT's checkpoint at once, sharing the machine's cores
        started, threads = [query, refs["gpt_pretrain"]], max(1, (os.cpu_count() or 2) // 2)
        continued = dataclasses.replace(config.pretrain, retriever=False, retro_flags=())
        refs["retro_pretrain"], refs["gpt_baseline"] = run_together(run, [
            ("retro_pretrain", dataclasses.asdict(dataclasses.replace(retro, threads=threads)), started),
            ("retro_pretrain", dataclasses.asdict(dataclasses.replace(continued, threads=threads)), started),
        ])  # fmt: skip
    else:
        refs["retro_pretrain"] = run("retro_pretrain", dataclasses.asdict(retro), [query])
        refs["gpt_baseline"] = refs["gpt_pretrain"]
    refs["retro_evaluate"] = run(
        "retro_evaluate",
        dataclasses.asdict(config.evaluate),
        [refs["retro_pretrain"], refs["gpt_baseline"], query],
    )
    return refs


def retro_stages(config: RetroFlowConfig, run: RunStage) -> dict[str, dict[str, Any]]:
    """Corpus, Retro data, then the two runs and their report: every stage's artifact reference."""
    return retro_model_stages(config, retro_data_stages(config, corpus_stages(config.corpus, run), run), run)


def result_lines(refs: dict[str, dict[str, Any]], store_url: str) -> list[str]:
    """The Retro result from the report: both validation perplexities, the database update's, and the ablation
    without neighbours with the leakage analysis's bits per byte."""
    report = json.loads(
        Path(_store_ref(refs["retro_evaluate"], store_url).local_path("report.json")).read_text()
    )
    update, leakage = report["database_update"], report["leakage"]
    bpb = leakage["bits_per_byte"]
    return [
        f"validation perplexity ({report['validation_samples']} samples): "
        f"Retro {report['retro']['valid_ppl']:.3f} (with the next sample's neighbours "
        f"{report['retro']['valid_ppl_other_neighbours']:.3f}), GPT baseline {report['gpt']['valid_ppl']:.3f}",
        f"database update (+{update['added_documents']} validation documents, {update['added_chunks']} chunks, "
        f"no retraining): Retro {update['retro_ppl_before']:.3f} -> {update['retro_ppl_after']:.3f}, "
        f"GPT {update['gpt_ppl_before']:.3f} -> {update['gpt_ppl_after']:.3f}; mean overlap of a chunk with the "
        f"neighbours before it {update['overlap_before']:.3f} -> {update['overlap_after']:.3f}",
        f"Retro without neighbours {report['retro']['valid_ppl_no_neighbours']:.3f}; bits per byte Retro "
        f"{bpb['retro']['unfiltered']:.4f}, GPT {bpb['gpt']['unfiltered']:.4f}; filtered (overlap <= "
        f"{leakage['filter_overlap']:g}, {leakage['filtered_chunks']} of {leakage['chunks']} chunks): Retro "
        f"{bpb['retro']['filtered']:.4f}, GPT {bpb['gpt']['filtered']:.4f}",
    ]


def project_dir(refs: dict[str, dict[str, Any]], store_url: str) -> str:
    """The local Retro project directory of the query stage's artifact (`--retro-project-dir`)."""
    return local_dir(_store_ref(refs["retro_query"], store_url))


def committed_retro(config: RetroFlowConfig) -> dict[str, dict[str, Any]] | None:
    """Every stage's committed artifact, or None when some stage has work to do (decided from the store)."""
    return committed_stages(config.corpus, lambda run: retro_stages(config, run))


@flow(name="retro")
def retro_flow(config: RetroFlowConfig = RetroFlowConfig()) -> dict[str, Any]:
    """Raw text to a Retro project directory, both runs and their report; returns every stage's artifact
    reference."""
    store = config.corpus.store
    refs = retro_stages(config, stage_runner(config.corpus))
    get_run_logger().info(
        "retro summary\n%s\nproject: %s", summary_table(summarize(refs, store)), project_dir(refs, store)
    )
    publish_stages("retro", refs, store)
    publish_report(
        refs["retro_evaluate"],
        store,
        key="retro-report",
        description="Retro against its GPT baseline: perplexities, the database update, loss curves",
    )
    return refs


def run_retro(config: RetroFlowConfig) -> dict[str, Any]:
    """Run the flow on the task runner the corpus config names."""
    corpus = config.corpus
    runner = make_task_runner(corpus.task_runner, corpus.workers, corpus.cluster_address)
    return retro_flow.with_options(task_runner=runner)(config)


@command_line
def main(argv: list[str] | None = None) -> int:
    config = parse_config(RetroFlowConfig, argv, description=__doc__.split("\n")[0])
    refs = committed_retro(config)
    if refs is None:  # work to do: only now start (or connect to) a Prefect server
        ArtifactStore(config.corpus.store).check_writable()
        with prefect_api():
            refs = run_retro(config)
    print(summary_table(summarize(refs, config.corpus.store)))
    print(f"retro project: {project_dir(refs, config.corpus.store)}")
    print("\n".join(result_lines(refs, config.corpus.store)))
    for warning in unused_rebuilds(config.corpus, refs, "retro"):
        print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
