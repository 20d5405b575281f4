"""The Retro evaluate stage: the Retro run against its GPT baseline, the ablations, the leakage analysis and the
database update, as a report (report.json, report.md, loss_curves.png of both runs, leakage.png).

Inputs: the Retro run and the GPT run (`retro_pretrain` artifacts, with and without `--retro-add-retriever`)
and the `retro_query` artifact (the project both trained on). Both models are scored on the same samples of
the project's validation split, Retro with the neighbours the query stage saved for them, with the next
sample's, and with none (the ablations). The Retro paper's leakage analysis (`retro.leakage`) buckets the
predicted chunks by how much of them the neighbours hold and gives both models' loss per bucket and bits per
byte. Then the validation documents are added to the database and index (`retro.update`) and their samples'
neighbours queried again: Retro's perplexity on them should fall while the GPT's, which reads no database,
stays the same. See docs/architecture.md (Retro flow).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
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
from retro.leakage import LeakageChunks, chunk_overlaps
from retro.project import RetroProject, db_dir, embedder_dir, index_path
from retro.update import update_database
from stages.base import Inputs, Stage, expect_inputs
from stages.evaluate import batch_losses, read_metrics
from stages.pretrain import run_directory
from stages.retro_params import local_dir
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter
from storage.atomic import atomic_write_text

log = logging.getLogger("megatron_flow.stage.retro_evaluate")

LOSS_CURVES = "loss_curves.png"
LEAKAGE_PLOT = "leakage.png"


@dataclass(frozen=True)
class RetroEvaluateParams:
    """How many validation samples both models are scored on (None: all the project queried), the overlap
    r(C) up to which a chunk counts in the filtered bits per byte (1/8: at most 8 of 64 tokens in a run the
    neighbours hold), and the search settings of the database update's re-query."""

    validation_samples: int | None = None
    micro_batch_size: int = 16
    filter_overlap: float = 0.125
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


class SwappedNeighbours(torch.utils.data.Dataset):
    """The first `samples` samples of a RetroDataset with neighbours other than their own: `"next"` the next
    sample's (neighbours that say nothing about the text: the gap to Retro's own score is what retrieval gives
    it), `"none"` none at all (every neighbour EOD padding, as a chunk the query found nothing for: what Retro
    scores on its decoder and extra layers alone)."""

    def __init__(self, dataset: RetroDataset, samples: int, swap: str) -> None:
        if swap not in ("next", "none"):
            raise ValueError(f"swap must be 'next' or 'none', got {swap!r}")
        self.dataset = dataset
        self.samples = samples
        self.swap = swap

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        sample = self.dataset[index]
        if self.swap == "next":
            neighbours = self.dataset[(index + 1) % self.samples]["neighbor_tokens"]
        else:
            neighbours = np.full_like(sample["neighbor_tokens"], self.dataset.eod)
        return {**sample, "neighbor_tokens": neighbours}


def token_losses(model: torch.nn.Module, dataset, samples: int, micro_batch_size: int) -> np.ndarray:
    """float [samples, seq_length]: the loss at each position of the first `samples` samples, 0 where the loss
    mask is 0."""
    batches = batch_losses(model, dataset, micro_batch_size, samples)
    return np.concatenate([(losses * loss_mask).numpy() for losses, loss_mask in batches])


def perplexity(losses: np.ndarray, loss_mask: np.ndarray) -> dict:
    """Mean loss over the masked-in positions and its perplexity."""
    tokens = float(loss_mask.sum())
    loss = float(losses.sum()) / max(tokens, 1.0)
    return {"loss": loss, "ppl": math.exp(min(20.0, loss)), "tokens": int(tokens)}


def samples_with_neighbours(dataset: RetroDataset, samples: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens [l * m], neighbour tokens [l, k, r]) of the first `samples` samples."""
    return [
        (np.asarray(s["tokens"]), np.asarray(s["neighbor_tokens"]))
        for s in map(dataset.__getitem__, range(samples))
    ]


def mean_overlap(dataset: RetroDataset, samples: int) -> float:
    """The mean overlap r(C) of the first `samples` samples' chunks with the neighbours before them."""
    pairs = samples_with_neighbours(dataset, samples)
    return float(np.concatenate([chunk_overlaps(t, n, dataset.chunk_length) for t, n in pairs]).mean())


def leakage_analysis(
    dataset: RetroDataset,
    samples: int,
    losses: dict[str, np.ndarray],
    detokenize: Callable[[list[int]], str],
    filter_overlap: float,
) -> dict:
    """`retro.leakage` on the first `samples` samples with their neighbours: per overlap bucket the chunks and
    each model's loss, and bits per byte unfiltered and filtered at `filter_overlap`."""
    pairs = samples_with_neighbours(dataset, samples)
    chunks = LeakageChunks.collect(pairs, losses, dataset.chunk_length, detokenize)
    return {
        "filter_overlap": filter_overlap,
        "chunks": len(chunks.overlap),
        "filtered_chunks": int((chunks.overlap <= filter_overlap).sum()),
        "mean_overlap": float(chunks.overlap.mean()),
        "buckets": chunks.buckets(),
        "bits_per_byte": chunks.bits_per_byte(filter_overlap),
    }


def plot_leakage(buckets: list[dict], path: str) -> None:
    """Each model's loss per overlap bucket (the Retro paper's figure 6, per bucket), chunk counts on the axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in buckets if row["chunks"]]
    labels = [f"{row['low']:.3g}-{row['high']:.3g}\n({row['chunks']} chunks)" for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for name, color in (("retro", "tab:blue"), ("gpt", "tab:orange")):
        ax.plot(
            labels,
            [row[name] for row in rows],
            "o-",
            color=color,
            label="Retro" if name == "retro" else "GPT",
        )
    ax.set_xlabel("overlap r(C) of a chunk with the neighbours retrieved for the chunk before it")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Loss per overlap bucket (Retro paper, leakage analysis)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_loss_curves(runs: dict[str, tuple[str, int]], path: str) -> None:
    """Training (lines) and validation (dots) loss of each named run's (metrics.jsonl, first iteration) on one
    plot; a retro-fitted run starts where the run it was fitted from ended."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for (name, (metrics_file, start)), color in zip(runs.items(), ("tab:blue", "tab:orange"), strict=False):
        train, valid, _ = read_metrics(metrics_file)
        ax.plot([start + r["iteration"] for r in train], [r["lm loss"] for r in train], color=color, alpha=0.6,
                label=f"{name} training")  # fmt: skip
        ax.plot([start + r["iteration"] for r in valid], [r["lm loss"] for r in valid], "o-", color=color,
                label=f"{name} validation")  # fmt: skip
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (nats/token)")
    ax.set_title("Retro vs GPT baseline (same decoder and samples)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _training_line(report: dict) -> str:
    retro, gpt = report["retro"], report["gpt"]
    if retro["retro_fitted_from"] is None:
        return f"Same decoder, {retro['iteration']} iterations on the same samples."
    if gpt.get("continued_from") == retro["retro_fitted_from"]:
        return (
            "Both started from one GPT run's checkpoint: Retro retro-fitted from it (the GPT's weights, the encoder "
            "and chunked cross-attention new), the GPT baseline continued from it; each trained "
            f"{retro['iteration']} iterations more on the same samples."
        )
    return (
        f"The GPT trained {gpt['iteration']} iterations; Retro was retro-fitted from it (the GPT's weights, the "
        f"encoder and chunked cross-attention new) and trained {retro['iteration']} iterations more on the same "
        "samples."
    )


def _ppl_row(name: str, scores: dict) -> str:
    return f"| {name} | {scores['parameters']:,} | {scores['valid_loss']:.4f} | {scores['valid_ppl']:.3f} |"


def markdown_report(report: dict) -> str:
    retro, gpt, update, leakage = report["retro"], report["gpt"], report["database_update"], report["leakage"]
    ablations = report["ablations"]
    bpb = leakage["bits_per_byte"]
    return "\n".join([
        "# Retro vs GPT baseline",
        "",
        f"{_training_line(report)} Both scored on {report['validation_samples']} validation samples "
        f"({retro['valid_tokens']:,} tokens).",
        "",
        f"![loss curves]({LOSS_CURVES})",
        "",
        "| model | parameters | validation loss | validation perplexity |",
        "| --- | --- | --- | --- |",
        _ppl_row("Retro", retro),
        _ppl_row("GPT", gpt),
        "",
        "## Ablations",
        "",
        "The same samples, Retro given other neighbours than its own (the gap to its own is what retrieval "
        "gives it), and the GPT:",
        "",
        "| model | neighbours | validation perplexity |",
        "| --- | --- | --- |",
        f"| Retro | its own | {ablations['retro_own_neighbours']:.3f} |",
        f"| Retro | the next sample's | {ablations['retro_next_sample_neighbours']:.3f} |",
        f"| Retro | none (all padding) | {ablations['retro_no_neighbours']:.3f} |",
        f"| GPT | - | {ablations['gpt']:.3f} |",
        "",
        "## Leakage (Retro paper, section 2.6)",
        "",
        f"For each of the {leakage['chunks']:,} predicted chunks after a sample's first, its overlap r(C): the "
        "fraction of its tokens in its longest common token substring with any neighbour retrieved for the chunk "
        f"before it (mean {leakage['mean_overlap']:.3f}). Loss in nats per token:",
        "",
        f"![loss per overlap bucket]({LEAKAGE_PLOT})",
        "",
        "| overlap r(C) | chunks | Retro loss | GPT loss | GPT - Retro |",
        "| --- | --- | --- | --- | --- |",
        *(_bucket_row(row) for row in leakage["buckets"]),
        "",
        f"Bits per byte over these chunks: Retro {bpb['retro']['unfiltered']:.4f}, GPT "
        f"{bpb['gpt']['unfiltered']:.4f}; filtered (only chunks with r(C) <= {leakage['filter_overlap']:g}): Retro "
        f"{bpb['retro']['filtered']:.4f}, GPT {bpb['gpt']['filtered']:.4f}.",
        "",
        "## Database update",
        "",
        f"The {update['added_documents']} validation documents ({update['added_chunks']:,} chunks) added to the "
        f"database and index without retraining; {update['queried_chunks']:,} chunks re-queried. Mean overlap "
        f"r(C) of a chunk with the neighbours retrieved before it: {update['overlap_before']:.3f} before, "
        f"{update['overlap_after']:.3f} after.",
        "",
        "| model | perplexity before | perplexity after |",
        "| --- | --- | --- |",
        f"| Retro | {update['retro_ppl_before']:.3f} | {update['retro_ppl_after']:.3f} |",
        f"| GPT | {update['gpt_ppl_before']:.3f} | {update['gpt_ppl_after']:.3f} |",
    ]) + "\n"  # fmt: skip


def _bucket_row(row: dict) -> str:
    if not row["chunks"]:
        return f"| {row['low']:g} - {row['high']:g} | 0 | - | - | - |"
    return (
        f"| {row['low']:g} - {row['high']:g} | {row['chunks']} | {row['retro']:.3f} | {row['gpt']:.3f} | "
        f"{row['gpt'] - row['retro']:.3f} |"
    )


def _model_scores(
    run: ArtifactRef, model: torch.nn.Module, losses: np.ndarray, loss_mask: np.ndarray
) -> dict:
    score = perplexity(losses, loss_mask)
    return {
        "run": run.url,
        "iteration": run.manifest().get("iteration"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "valid_loss": score["loss"],
        "valid_ppl": score["ppl"],
        "valid_tokens": score["tokens"],
    }


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
    batch = params.micro_batch_size
    loss_mask = np.stack([np.asarray(valid[i]["loss_mask"], dtype=np.float32) for i in range(samples)])
    losses = {
        "retro": token_losses(retro_model, valid, samples, batch),
        "gpt": token_losses(gpt_model, gpt_data[1], samples, batch),
    }
    swapped = {
        swap: perplexity(token_losses(retro_model, SwappedNeighbours(valid, samples, swap), samples, batch), loss_mask)
        for swap in ("next", "none")
    }  # fmt: skip
    scores = {
        "retro": {
            **_model_scores(retro_run, retro_model, losses["retro"], loss_mask),
            "retro_fitted_from": retro_run.manifest().get("retro_fitted_from"),
            "valid_ppl_other_neighbours": swapped["next"]["ppl"],
            "valid_ppl_no_neighbours": swapped["none"]["ppl"],
        },
        "gpt": {
            **_model_scores(gpt_run, gpt_model, losses["gpt"], loss_mask),
            "continued_from": gpt_run.manifest().get("continued_from"),
        },
    }
    gpt_tokenizer = tokenizer_from_config(config.tokenizer)
    leakage = leakage_analysis(valid, samples, losses, gpt_tokenizer.detokenize, params.filter_overlap)
    update, updated = _database_update(params, config, valid, samples, project_dir, gpt_tokenizer)
    retro_after = perplexity(token_losses(retro_model, updated, samples, batch), loss_mask)
    gpt_after = perplexity(token_losses(gpt_model, gpt_data[1], samples, batch), loss_mask)
    report = {
        "validation_samples": samples,
        "retro": scores["retro"],
        "gpt": scores["gpt"],
        "ablations": {
            "retro_own_neighbours": scores["retro"]["valid_ppl"],
            "retro_next_sample_neighbours": swapped["next"]["ppl"],
            "retro_no_neighbours": swapped["none"]["ppl"],
            "gpt": scores["gpt"]["valid_ppl"],
        },
        "leakage": leakage,
        "database_update": {
            "added_documents": update.added_documents,
            "added_chunks": update.added_chunks,
            "queried_chunks": update.queried_chunks,
            "overlap_before": leakage["mean_overlap"],
            "overlap_after": mean_overlap(updated, samples),
            "retro_ppl_before": scores["retro"]["valid_ppl"],
            "retro_ppl_after": retro_after["ppl"],
            "gpt_ppl_before": scores["gpt"]["valid_ppl"],
            "gpt_ppl_after": gpt_after["ppl"],
        },
    }  # fmt: skip
    _write_report(writer, report, retro_run, gpt_run)
    log.info("retro evaluate: %s", json.dumps(report["ablations"]))
    return {
        "retro_valid_ppl": scores["retro"]["valid_ppl"],
        "gpt_valid_ppl": scores["gpt"]["valid_ppl"],
        "seconds_evaluating": round(time.time() - started, 3),
    }


def _database_update(
    params: RetroEvaluateParams,
    config,
    valid: RetroDataset,
    samples: int,
    project_dir: str,
    gpt_tokenizer,
) -> tuple:
    """The validation documents added to the database and index (`retro.update`), and the first `samples`
    validation samples with the neighbours re-queried from it."""
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
    return update, updated


def _write_report(writer: ArtifactWriter, report: dict, retro_run: ArtifactRef, gpt_run: ArtifactRef) -> None:
    """report.json, report.md and the two plots into the artifact."""
    for name, text in (("report.json", json.dumps(report, indent=2)), ("report.md", markdown_report(report))):
        path = os.path.join(writer.local_dir, name)
        atomic_write_text(path, text)
        writer.put_file(path, name)
    # a Retro run retro-fitted from the GPT of the plot starts where the GPT's curve is at its last iteration
    fitted = report["retro"]["retro_fitted_from"] not in (None, report["gpt"]["continued_from"])
    curves = {
        "Retro": (os.path.join(run_directory(retro_run), "metrics.jsonl"), report["gpt"]["iteration"] if fitted else 0),
        "GPT": (os.path.join(run_directory(gpt_run), "metrics.jsonl"), 0),
    }  # fmt: skip
    plots = {LOSS_CURVES: lambda path: plot_loss_curves(curves, path),
             LEAKAGE_PLOT: lambda path: plot_leakage(report["leakage"]["buckets"], path)}  # fmt: skip
    for name, plot in plots.items():
        path = os.path.join(writer.local_dir, name)
        plot(path)
        writer.put_file(path, name)


class RetroEvaluateStage(Stage):
    name = "retro_evaluate"
    version = "5"
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
