"""The Retro evaluate stage: the Retro run against its GPT baseline, and the database update, as a report
(report.json, report.md, loss_curves.png of both runs).

Inputs: the Retro run and the GPT run (`retro_pretrain` artifacts, with and without `--retro-add-retriever`)
and the `retro_query` artifact (the project both trained on). Both models are scored on the same samples of
the project's validation split, Retro with the neighbours the query stage saved for them. Then the validation
documents are added to the database and index (`retro.update`) and their samples' neighbours queried again:
Retro's perplexity on them should fall while the GPT's, which reads no database, stays the same. See
docs/architecture.md (Retro flow).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from megatron_train.checkpointing import load_model_for_inference
from megatron_train.data.retro_dataset import RetroDataset
from megatron_train.tokenizer import tokenizer_from_config
from retro.db import ChunkDatabase
from retro.embedder import embedder_tokenizer, load_embedder
from retro.family import datasets_provider
from retro.index import load_index
from retro.project import RetroProject, db_dir, embedder_dir, index_path
from retro.update import update_database
from stages.base import Inputs, Stage, expect_inputs
from stages.evaluate import held_out_loss, read_metrics
from stages.pretrain import run_directory
from stages.retro_params import local_dir
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter
from storage.atomic import atomic_write_text

log = logging.getLogger("megatron_flow.stage.retro_evaluate")

LOSS_CURVES = "loss_curves.png"


@dataclass(frozen=True)
class RetroEvaluateParams:
    """How many validation samples both models are scored on (None: all the project queried), and the search
    settings of the database update's re-query."""

    validation_samples: int | None = None
    micro_batch_size: int = 16
    nprobe: int = 16
    ef_search: int = 256


def _load_run(ref: ArtifactRef, project_dir: str, scratch: str) -> tuple[torch.nn.Module, object, tuple]:
    """(model, config, (train, valid, test) datasets) of a retro_pretrain run, read from `project_dir`."""
    model, config = load_model_for_inference(run_directory(ref))
    model.eval()
    project = RetroProject.load(project_dir)
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(
            config.data, data_path=project.data_path(project_dir), data_cache_path=scratch
        ),
        retro=dataclasses.replace(config.retro, retro_project_dir=project_dir),
    )
    tokenizer = tokenizer_from_config(config.tokenizer)
    return model, config, datasets_provider(config, tokenizer, project.num_samples())


class OtherSamplesNeighbours(torch.utils.data.Dataset):
    """The first `samples` samples of a RetroDataset, each with the next sample's neighbours: what Retro scores
    when its neighbours say nothing about its text, so the gap to its own score is what retrieval gives it."""

    def __init__(self, dataset: RetroDataset, samples: int) -> None:
        self.dataset = dataset
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        other = self.dataset[(index + 1) % self.samples]["neighbor_tokens"]
        return {**self.dataset[index], "neighbor_tokens": other}


def neighbour_overlap(dataset: RetroDataset, samples: int) -> float:
    """How much the neighbours could tell: over the first `samples` samples' chunks that have a next chunk in the
    sample, the mean share of the next chunk's token trigrams found in the tokens retrieved for the chunk (its
    neighbours and their continuations). Near 0, no model can gain from retrieval; near 1, copying pays."""
    shares = []
    for index in range(samples):
        sample = dataset[index]
        tokens, retrieved = np.asarray(sample["tokens"]), np.asarray(sample["neighbor_tokens"])
        m = dataset.chunk_length
        for chunk in range(retrieved.shape[0] - 1):
            wanted = _trigrams(tokens[(chunk + 1) * m : (chunk + 2) * m])
            found = set().union(*(_trigrams(neighbour) for neighbour in retrieved[chunk]))
            shares.append(len(wanted & found) / len(wanted) if wanted else 0.0)
    return float(np.mean(shares)) if shares else 0.0


def _trigrams(tokens: np.ndarray) -> set[tuple[int, ...]]:
    return set(zip(tokens[:-2].tolist(), tokens[1:-1].tolist(), tokens[2:].tolist(), strict=True))


def plot_loss_curves(runs: dict[str, str], path: str) -> None:
    """Training (lines) and validation (dots) loss of each named run's metrics.jsonl on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for (name, metrics_file), color in zip(runs.items(), ("tab:blue", "tab:orange"), strict=False):
        train, valid, _ = read_metrics(metrics_file)
        ax.plot([r["iteration"] for r in train], [r["lm loss"] for r in train], color=color, alpha=0.6,
                label=f"{name} training")  # fmt: skip
        ax.plot([r["iteration"] for r in valid], [r["lm loss"] for r in valid], "o-", color=color,
                label=f"{name} validation")  # fmt: skip
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (nats/token)")
    ax.set_title("Retro vs GPT baseline (same decoder, steps and samples)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def markdown_report(report: dict) -> str:
    retro, gpt, update = report["retro"], report["gpt"], report["database_update"]
    return "\n".join([
        "# Retro vs GPT baseline",
        "",
        f"Same decoder, {retro['iteration']} iterations on the same samples; both scored on "
        f"{report['validation_samples']} validation samples ({retro['valid_tokens']:,} tokens).",
        "",
        f"![loss curves]({LOSS_CURVES})",
        "",
        "| model | parameters | validation loss | validation perplexity |",
        "| --- | --- | --- | --- |",
        f"| Retro | {retro['parameters']:,} | {retro['valid_loss']:.4f} | {retro['valid_ppl']:.3f} |",
        f"| GPT | {gpt['parameters']:,} | {gpt['valid_loss']:.4f} | {gpt['valid_ppl']:.3f} |",
        "",
        f"Retro given the next sample's neighbours instead of its own: perplexity "
        f"{retro['valid_ppl_other_neighbours']:.3f} (the difference to {retro['valid_ppl']:.3f} is what its "
        "retrieval gives it; the rest of the gap to the GPT is the model's).",
        "",
        "## Database update",
        "",
        f"The {update['added_documents']} validation documents ({update['added_chunks']:,} chunks) added to the "
        f"database and index without retraining; {update['queried_chunks']:,} chunks re-queried. The share of "
        "each chunk's next-chunk token trigrams found in what was retrieved for it (what retrieval could tell "
        f"the model): {update['neighbour_overlap_before']:.3f} before, {update['neighbour_overlap_after']:.3f} "
        "after.",
        "",
        "| model | perplexity before | perplexity after |",
        "| --- | --- | --- |",
        f"| Retro | {update['retro_ppl_before']:.3f} | {update['retro_ppl_after']:.3f} |",
        f"| GPT | {update['gpt_ppl_before']:.3f} | {update['gpt_ppl_after']:.3f} |",
    ]) + "\n"  # fmt: skip


def _evaluate(
    params: RetroEvaluateParams,
    retro_run: ArtifactRef,
    gpt_run: ArtifactRef,
    query: ArtifactRef,
    writer: ArtifactWriter,
) -> dict:
    started = time.time()
    project_dir = local_dir(query)
    scratch = os.path.join(writer.local_dir, "data_cache")
    retro_model, config, retro_data = _load_run(retro_run, project_dir, scratch)
    gpt_model, _, gpt_data = _load_run(gpt_run, project_dir, scratch)
    if config.retro.retro_add_retriever is not True or not isinstance(retro_data[1], RetroDataset):
        raise ValueError(
            f"{retro_run.url}: the first input must be the Retro run (--retro-add-retriever), the second the GPT"
        )
    valid = retro_data[1]
    samples = len(valid) if params.validation_samples is None else min(params.validation_samples, len(valid))
    scores = {}
    for name, model, dataset, run in (("retro", retro_model, valid, retro_run), ("gpt", gpt_model, gpt_data[1], gpt_run)):  # fmt: skip
        loss = held_out_loss(model, dataset, params.micro_batch_size, samples)
        scores[name] = {
            "run": run.url,
            "iteration": run.manifest().get("iteration"),
            "parameters": sum(p.numel() for p in model.parameters()),
            "valid_loss": loss["lm_loss"],
            "valid_ppl": loss["ppl"],
            "valid_tokens": loss["tokens"],
        }

    other = held_out_loss(
        retro_model, OtherSamplesNeighbours(valid, samples), params.micro_batch_size, samples
    )
    scores["retro"]["valid_ppl_other_neighbours"] = other["ppl"]

    gpt_tokenizer = tokenizer_from_config(config.tokenizer)
    retro = config.retro
    update = update_database(
        valid.gpt_dataset,
        samples,
        ChunkDatabase(db_dir(project_dir)),
        load_index(index_path(project_dir), params.nprobe, params.ef_search),
        load_embedder(embedder_dir(project_dir)),
        gpt_tokenizer,
        embedder_tokenizer(embedder_dir(project_dir)),
        retro.retro_chunk_length,
        retro.retro_num_neighbors,
    )
    updated = RetroDataset(
        valid.gpt_dataset, update.neighbours, update.db, config.model.seq_length, retro.retro_chunk_length,
        retro.retro_num_neighbors, retro.retro_num_retrieved_chunks, gpt_tokenizer.eod, verify_neighbor_count=False,
    )  # fmt: skip
    retro_after = held_out_loss(retro_model, updated, params.micro_batch_size, samples)
    gpt_after = held_out_loss(gpt_model, gpt_data[1], params.micro_batch_size, samples)
    report = {
        "validation_samples": samples,
        "retro": scores["retro"],
        "gpt": scores["gpt"],
        "database_update": {
            "added_documents": update.added_documents,
            "added_chunks": update.added_chunks,
            "queried_chunks": update.queried_chunks,
            "neighbour_overlap_before": neighbour_overlap(valid, samples),
            "neighbour_overlap_after": neighbour_overlap(updated, samples),
            "retro_ppl_before": scores["retro"]["valid_ppl"],
            "retro_ppl_after": retro_after["ppl"],
            "gpt_ppl_before": scores["gpt"]["valid_ppl"],
            "gpt_ppl_after": gpt_after["ppl"],
        },
    }
    for name, text in (("report.json", json.dumps(report, indent=2)), ("report.md", markdown_report(report))):
        path = os.path.join(writer.local_dir, name)
        atomic_write_text(path, text)
        writer.put_file(path, name)
    plot = os.path.join(writer.local_dir, LOSS_CURVES)
    plot_loss_curves(
        {"Retro": os.path.join(run_directory(retro_run), "metrics.jsonl"),
         "GPT": os.path.join(run_directory(gpt_run), "metrics.jsonl")},
        plot,
    )  # fmt: skip
    writer.put_file(plot, LOSS_CURVES)
    log.info("retro evaluate: %s", json.dumps(report["database_update"]))
    return {
        "retro_valid_ppl": scores["retro"]["valid_ppl"],
        "gpt_valid_ppl": scores["gpt"]["valid_ppl"],
        "seconds_evaluating": round(time.time() - started, 3),
    }


class RetroEvaluateStage(Stage):
    name = "retro_evaluate"
    version = "3"
    libraries = ("faiss-cpu", "torch")
    Params = RetroEvaluateParams

    def run(self, params: RetroEvaluateParams, inputs: Inputs, store: ArtifactStore) -> ArtifactRef:
        """Compare the runs of `inputs` ([Retro retro_pretrain, GPT retro_pretrain, retro_query])."""
        retro_run, gpt_run, query = expect_inputs(
            self,
            inputs,
            3,
            "[Retro retro_pretrain artifact, GPT retro_pretrain artifact, retro_query artifact]",
        )
        return self.build_artifact(
            params, inputs, store, lambda writer: _evaluate(params, retro_run, gpt_run, query, writer)
        )


STAGE = RetroEvaluateStage()
run = STAGE.run
key = STAGE.key
