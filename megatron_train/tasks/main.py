"""Zero-shot evaluation of a checkpoint, with the command line of Megatron's tasks/main.py.

    python -m megatron_train.tasks.main --task WIKITEXT103 --valid-data wiki.test.tokens --load CKPT \\
        [--overlapping-eval 32] [--seq-length 1024]
    python -m megatron_train.tasks.main --task LAMBADA --strict-lambada --valid-data lambada_test.jsonl --load CKPT
    python -m megatron_train.tasks.main --task VALID_PPL --valid-data DATA_text_document --load CKPT

Prints Megatron's result line between dashed rules; `--results-json PATH` also writes the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from megatron_train.device import get_device
from megatron_train.evaluation.lambada import evaluate_lambada
from megatron_train.evaluation.perplexity import validation_perplexity
from megatron_train.evaluation.wikitext import evaluate_wikitext
from megatron_train.inference.checkpoint import add_checkpoint_args, load_for_inference

TASKS = ("WIKITEXT103", "LAMBADA", "VALID_PPL")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument(
        "--valid-data",
        nargs="+",
        required=True,
        help="wiki.test.tokens (WIKITEXT103), a JSONL file (LAMBADA) or a .bin/.idx prefix (VALID_PPL).",
    )
    add_checkpoint_args(parser)
    parser.add_argument("--seq-length", type=int, default=None, help="Window length; default: the model's.")
    parser.add_argument(
        "--overlapping-eval",
        type=int,
        default=None,
        help="Sliding window stride: after the first window only its last N tokens are scored.",
    )
    parser.add_argument("--strict-lambada", action="store_true", help="Score the whole last word (LAMBADA).")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument(
        "--max-eval-tokens", type=int, default=None, help="Evaluate at most N tokens (VALID_PPL)."
    )
    parser.add_argument("--results-json", default=None, help="Also write the metrics to this JSON file.")
    return parser


def run_task(args: argparse.Namespace, model, tokenizer, config):
    """The task's result object (it has `megatron_line()`)."""
    if len(args.valid_data) != 1:
        raise ValueError(f"--valid-data takes one path for {args.task}, got {len(args.valid_data)}")
    path = args.valid_data[0]
    seq_length = args.seq_length or config.model.seq_length
    if args.task == "WIKITEXT103":
        return evaluate_wikitext(
            model, tokenizer, path, seq_length, args.overlapping_eval, args.micro_batch_size
        )
    if args.task == "LAMBADA":
        return evaluate_lambada(
            model, tokenizer, path, seq_length, args.strict_lambada, args.micro_batch_size
        )
    return validation_perplexity(
        model, path, seq_length, args.overlapping_eval, args.micro_batch_size, args.max_eval_tokens
    )


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model, tokenizer, config = load_for_inference(args, device=get_device())
    result = run_task(args, model, tokenizer, config)
    line = result.megatron_line(args.task)
    print("-" * (len(line) + 1))
    print(line)
    print("-" * (len(line) + 1))
    metrics = {
        "task": args.task,
        "valid_data": args.valid_data[0],
        "load": args.load,
        **dataclasses.asdict(result),
    }
    if hasattr(result, "accuracy"):
        metrics["accuracy"] = result.accuracy
    if args.results_json:
        with open(args.results_json, "w", encoding="utf-8") as handle:
            json.dump(metrics, handle, indent=2)
    return metrics


if __name__ == "__main__":
    main()
