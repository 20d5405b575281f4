"""The evaluate stage: a trained run's report, as JSON, Markdown and PNG loss curves.

Inputs: the pretrain artifact (the run directory) and the tokenize artifact it was trained on, and optionally a
baseline's pretrain artifact trained on the same data (the eval flow's `--baseline`: a hybrid model beside the GPT
of the same flags). The report holds the run's training and validation losses (from its metrics file, plotted),
the perplexity of the whole held-out validation split (the `--split` the run used, every sample once), sample
generations, and, when their files are given, WikiText-103 perplexity and LAMBADA accuracy computed as Megatron's
tasks do; with a baseline, both models' families, parameter counts and validation losses side by side.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_train.checkpointing import load_model_for_inference
from megatron_train.data.builder import build_train_valid_test_datasets
from megatron_train.data.samplers import collate
from megatron_train.evaluation.lambada import evaluate_lambada
from megatron_train.evaluation.wikitext import evaluate_wikitext
from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.tokenizer import tokenizer_from_config
from stages.base import Inputs, Stage, expect_inputs
from stages.pretrain import run_directory
from storage.artifacts import (
    ArtifactRef,
    ArtifactStore,
    ArtifactWriter,
)

log = logging.getLogger("megatron_flow.stage.evaluate")


@dataclass(frozen=True)
class EvaluateParams:
    """What goes into the report; the sampling settings make the sample generations reproducible."""

    prompts: tuple[str, ...] = ("In the beginning", "And the LORD said unto Moses,", "Blessed are the")
    tokens_to_generate: int = 48
    temperature: float = 0.8
    top_p: float = 0.9
    seed: int = 1234
    micro_batch_size: int = 8
    max_validation_samples: int | None = None  # None: the whole validation split
    wikitext_path: str | None = None  # a wiki.test.tokens file
    lambada_path: str | None = None  # a lambada_test.jsonl file
    strict_lambada: bool = True
    overlapping_eval: int | None = None


@torch.no_grad()
def batch_losses(model: torch.nn.Module, dataset, micro_batch_size: int, count: int) -> Iterator[tuple]:
    """(per-token losses [b, s], loss mask [b, s]) of the first `count` samples, a micro-batch at a time (Megatron's
    masking); a Retro dataset's samples carry their neighbours, which the model then attends to; samples with
    document ids (--reset-attention-mask) attend within their documents, as in training."""
    for start in range(0, count, micro_batch_size):
        batch = collate([dataset[i] for i in range(start, min(count, start + micro_batch_size))])
        extra = {key: batch[key] for key in ("neighbor_tokens", "document_ids") if key in batch}
        losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], **extra).float()
        yield losses, batch["loss_mask"]


def held_out_loss(model: torch.nn.Module, dataset, micro_batch_size: int, limit: int | None) -> dict:
    """Mean token loss over the validation split's samples (`batch_losses`), and its perplexity."""
    count = len(dataset) if limit is None else min(limit, len(dataset))
    total, tokens = 0.0, 0.0
    for losses, loss_mask in batch_losses(model, dataset, micro_batch_size, count):
        total += float((losses * loss_mask).sum())
        tokens += float(loss_mask.sum())
    loss = total / max(tokens, 1.0)
    return {"samples": count, "tokens": int(tokens), "lm_loss": loss, "ppl": math.exp(min(20.0, loss))}


def read_metrics(path: str) -> tuple[list[dict], list[dict], dict | None]:
    """(training records, validation records during training, the end-of-training validation record) of a
    run's metrics.jsonl."""
    train, valid, end = [], [], None
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record.get("split") == "valid" and record.get("end_of_training"):
                    end = record
                elif record.get("split") == "valid":
                    valid.append(record)
                elif "split" not in record and record.get("lm loss") is not None:
                    train.append(record)
    return train, valid, end


def plot_loss_curves(train: list[dict], valid: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot([r["iteration"] for r in train], [r["lm loss"] for r in train], label="training loss")
    if valid:
        ax.plot([r["iteration"] for r in valid], [r["lm loss"] for r in valid], "o-", label="validation loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (nats/token)")
    ax.set_title("Loss curves")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def markdown_report(report: dict) -> str:
    run = report["run"]
    lines = [
        "# Evaluation report",
        "",
        f"Checkpoint: `{run['checkpoint']}` (iteration {run['iteration']}, "
        f"{run['parameters']:,} parameters, {run['consumed_train_samples']:,} training samples)",
        "",
        "![loss curves](loss_curves.png)",
        "",
        "| metric | value |",
        "| --- | --- |",
    ]
    for name, value in report["metrics"].items():
        lines.append(f"| {name} | {value:.4f} |" if isinstance(value, float) else f"| {name} | {value} |")
    if "baseline" in report:
        lines += [
            "",
            "## Beside the baseline (same data and steps)",
            "",
            "| | this model | baseline |",
            "| --- | --- | --- |",
        ]
        for row in COMPARED:
            ours, theirs = report["run"][row], report["baseline"][row]
            cells = (
                f"{v:,}" if isinstance(v, int) else f"{v:.4f}" if isinstance(v, float) else str(v)
                for v in (ours, theirs)
            )
            lines.append(f"| {row.replace('_', ' ')} | {' | '.join(cells)} |")
    lines += ["", "## Sample generations", ""]
    for sample in report["generations"]:
        lines += [f"**{sample['prompt']}**{sample['completion']}", ""]
    return "\n".join(lines) + "\n"


# What the report shows of the model and its baseline side by side.
COMPARED = ("family", "parameters", "iteration", "end_of_training_validation_loss", "held_out_loss")


def run_summary(pretrained: ArtifactRef, model: torch.nn.Module, end_of_training: dict | None) -> dict:
    """What the report says of a trained run: where it is, its family, size, progress and end-of-training loss."""
    manifest = pretrained.manifest()
    return {
        "checkpoint": pretrained.url,
        "family": model.model_type,
        "iteration": manifest.get("iteration"),
        "consumed_train_samples": manifest.get("consumed_train_samples", 0),
        "parameters": sum(p.numel() for p in model.parameters()),
        "end_of_training_validation_loss": None if end_of_training is None else end_of_training["lm loss"],
    }


def baseline_summary(baseline: ArtifactRef, valid, params: EvaluateParams) -> dict:
    """The baseline run's summary and its held-out loss on the model's validation samples."""
    run_dir = run_directory(baseline)
    model, _ = load_model_for_inference(run_dir)
    end_of_training = read_metrics(os.path.join(run_dir, "metrics.jsonl"))[2]
    summary = run_summary(baseline, model.eval(), end_of_training)
    held_out = held_out_loss(model, valid, params.micro_batch_size, params.max_validation_samples)
    return {**summary, "held_out_loss": held_out["lm_loss"]}


def _evaluate(
    params: EvaluateParams,
    pretrained: ArtifactRef,
    tokenized: ArtifactRef,
    writer: ArtifactWriter,
    baseline: ArtifactRef | None = None,
) -> dict:
    started = time.time()
    run_dir = run_directory(pretrained)
    model, config = load_model_for_inference(run_dir)
    model.eval()
    tokenizer = tokenizer_from_config(config.tokenizer)
    name = tokenized.manifest()["outputs"]["text"]
    tokenized.local_path(name + ".idx")
    prefix = tokenized.local_path(name + ".bin")[: -len(".bin")]
    data = dataclasses.replace(
        config.data, data_path=[prefix], data_cache_path=os.path.join(writer.local_dir, "data_cache")
    )
    _, valid, _ = build_train_valid_test_datasets(
        data, config.model.seq_length, (1, None, 1), config.training.seed, tokenizer.eod, tokenizer.vocab_size
    )
    metrics: dict = {}
    train, valid_records, end_of_training = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    if train:
        metrics["first training loss"] = train[0]["lm loss"]
        metrics["final training loss"] = train[-1]["lm loss"]
    if valid_records:
        metrics["first validation loss (run)"] = valid_records[0]["lm loss"]
        metrics["final validation loss (run)"] = valid_records[-1]["lm loss"]
    if end_of_training is not None:
        metrics["end-of-training validation loss (run)"] = end_of_training["lm loss"]
    if valid is not None:
        held_out = held_out_loss(model, valid, params.micro_batch_size, params.max_validation_samples)
        metrics["held-out loss (whole validation split)"] = held_out["lm_loss"]
        metrics["held-out perplexity"] = held_out["ppl"]
        metrics["held-out tokens"] = held_out["tokens"]
    seq_length = config.model.seq_length
    if params.wikitext_path:
        wiki = evaluate_wikitext(model, tokenizer, params.wikitext_path, seq_length, params.overlapping_eval)
        metrics["WikiText-103 adjusted perplexity"] = wiki.adjusted_ppl
    if params.lambada_path:
        lambada = evaluate_lambada(
            model, tokenizer, params.lambada_path, seq_length, strict=params.strict_lambada
        )
        metrics["LAMBADA accuracy"] = lambada.accuracy
    output = generate(
        model,
        tokenizer,
        list(params.prompts),
        GenerationParams(
            tokens_to_generate=params.tokens_to_generate,
            temperature=params.temperature,
            top_p=params.top_p,
            random_seed=params.seed,
        ),
    )
    run = run_summary(pretrained, model, end_of_training)
    run["held_out_loss"] = metrics.get("held-out loss (whole validation split)")
    report = {
        "run": run,
        "metrics": metrics,
        "generations": [
            {"prompt": p, "completion": c} for p, c in zip(params.prompts, output.completions, strict=True)
        ],
    }
    if baseline is not None:
        report["baseline"] = baseline_summary(baseline, valid, params)
    for filename, text in (
        ("report.json", json.dumps(report, indent=2)),
        ("report.md", markdown_report(report)),
    ):
        path = os.path.join(writer.local_dir, filename)
        with open(path, "w") as f:
            f.write(text)
        writer.put_file(path, filename)
    plot = os.path.join(writer.local_dir, "loss_curves.png")
    plot_loss_curves(train, valid_records, plot)
    writer.put_file(plot, "loss_curves.png")
    log.info(
        "evaluate: %s",
        ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()),
    )
    return {"metrics": metrics, "seconds_evaluating": round(time.time() - started, 3)}


class EvaluateStage(Stage):
    name = "evaluate"
    version = "1"
    libraries = ("torch",)
    Params = EvaluateParams

    def run(self, params: EvaluateParams, inputs: Inputs, store: ArtifactStore) -> ArtifactRef:
        """Evaluate the trained model of `inputs` ([pretrain artifact, tokenize artifact], and a baseline's
        pretrain artifact on the same data to report beside it)."""
        what = "[pretrain artifact, tokenize artifact] (and a baseline pretrain artifact)"
        pretrained, tokenized, *baseline = expect_inputs(self, inputs, 3 if len(inputs) == 3 else 2, what)
        return self.build_artifact(
            params,
            inputs,
            store,
            lambda writer: _evaluate(params, pretrained, tokenized, writer, *baseline),
        )


STAGE = EvaluateStage()
run = STAGE.run
key = STAGE.key
