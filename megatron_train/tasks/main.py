"""Megatron's tasks/main.py: zero-shot evaluation of a GPT checkpoint, and finetuning BERT on RACE, MNLI, QQP.

    python -m megatron_train.tasks.main --task WIKITEXT103 --valid-data wiki.test.tokens --load CKPT \\
        [--overlapping-eval 32] [--seq-length 1024]
    python -m megatron_train.tasks.main --task LAMBADA --strict-lambada --valid-data lambada_test.jsonl --load CKPT
    python -m megatron_train.tasks.main --task VALID_PPL --valid-data DATA_text_document --load CKPT
    python -m megatron_train.tasks.main --task RETRO-QA --valid-data nq_test.jsonl --load RETRO_CKPT \
        --retro-project-dir DIR [--ft-neighbours 5] [--out-seq-length 32]     (a GPT checkpoint: no project)
    torchrun --nproc-per-node 8 -m megatron_train.tasks.main --task WIKITEXT103 --valid-data wiki.test.tokens \\
        --load CKPT --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2      (2 data-parallel replicas)
    torchrun --nproc-per-node 2 -m megatron_train.tasks.main --task MNLI --pretrained-checkpoint BERT_CKPT \\
        --train-data MNLI/train.tsv --valid-data MNLI/dev_matched.tsv MNLI/dev_mismatched.tsv --epochs 3 \\
        --micro-batch-size 8 --lr 5e-5 --lr-warmup-fraction 0.065 --seq-length 128 --save FINETUNED --load FINETUNED
    ... --task RACE --train-data RACE/train/middle RACE/train/high --valid-data RACE/dev/middle RACE/dev/high
    ... --task MNLI --hf-dataset glue/mnli (a cached hub dataset or a save_to_disk folder instead of files)

The finetuning tasks (`tasks.finetune`) print Megatron's accuracy lines per validation set after each epoch.

WIKITEXT103, LAMBADA and VALID_PPL run under torchrun as Megatron's zero-shot evaluation does: world = TP x PP x
DP, each rank holds only its TP slice of its pipeline stage (read from the checkpoint, resharded on load; Megatron's
` > number of parameters on (tensor, pipeline) model parallel rank (t, p): N` line), the forward runs stage by
stage (`inference.forward.forward_step`) and the data-parallel replicas split the windows or examples
(`evaluation.ranks`); the numbers equal one process's. Run as one process, the whole model is evaluated whatever
the TP/PP flags say.

Takes Megatron's whole argument set, as its tasks/main.py does: model flags are checked against the checkpoint,
tokenizer flags replace the tokenizer it recorded, training-only flags are accepted and unused; `--seq-length`
is the evaluation window (default: the model's) and `--micro-batch-size` the batch (default 8). Prints
Megatron's result line between dashed rules; `--results-json PATH` also writes the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os

import torch.distributed as dist

from megatron_train.device import get_device
from megatron_train.evaluation.lambada import evaluate_lambada
from megatron_train.evaluation.perplexity import validation_perplexity
from megatron_train.evaluation.ranks import is_reporting_rank
from megatron_train.evaluation.wikitext import evaluate_wikitext
from megatron_train.inference.checkpoint import (
    add_family_flags,
    build_inference_parser,
    load_for_inference,
    start_model_parallel,
)
from megatron_train.parallel import state
from megatron_train.tasks.finetune.finetune import TASKS as FINETUNE_TASKS
from megatron_train.tasks.finetune.finetune import add_finetune_flags, run_finetune
from megatron_train.tasks.retro_qa import evaluate_qa
from megatron_train.training.entry import USER_ERRORS
from storage.atomic import atomic_write_text

ZERO_SHOT_TASKS = ("WIKITEXT103", "LAMBADA", "VALID_PPL", "RETRO-QA")
TASKS = (*ZERO_SHOT_TASKS, *FINETUNE_TASKS)
DEFAULT_MICRO_BATCH_SIZE = 8


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = build_inference_parser(__doc__)
    for action in parser._actions:
        action.required = False  # --load: required for the zero-shot tasks, checked in main
    group = parser.add_argument_group("tasks")
    group.add_argument("--task", required=True, choices=TASKS)
    group.add_argument(
        "--valid-data",
        nargs="+",
        default=None,
        help="wiki.test.tokens (WIKITEXT103), a JSONL file (LAMBADA), a .bin/.idx prefix (VALID_PPL), GLUE "
        ".tsv files (MNLI, QQP) or RACE folders (RACE/dev/middle RACE/dev/high).",
    )
    group.add_argument(
        "--overlapping-eval",
        type=int,
        default=None,
        help="Sliding window stride: after the first window only its last N tokens are scored.",
    )
    group.add_argument("--strict-lambada", action="store_true", help="Score the whole last word (LAMBADA).")
    group.add_argument(
        "--max-eval-tokens", type=int, default=None, help="Evaluate at most N tokens (VALID_PPL)."
    )
    group.add_argument("--results-json", default=None, help="Also write the metrics to this JSON file.")
    group.add_argument(
        "--ft-neighbours",
        type=int,
        default=5,
        help="Contexts (ctxs) put in each question's prompt (RETRO-QA).",
    )
    group.add_argument(
        "--out-seq-length", type=int, default=32, help="Tokens generated per answer (RETRO-QA)."
    )
    add_family_flags(parser, argv)
    add_finetune_flags(parser)
    return parser


def run_task(args: argparse.Namespace, model, tokenizer, config):
    """The task's result object (it has `megatron_line()`)."""
    if len(args.valid_data) != 1:
        raise ValueError(f"--valid-data takes one path for {args.task}, got {len(args.valid_data)}")
    path = args.valid_data[0]
    seq_length = getattr(args, "seq_length", None) or config.model.seq_length
    batch_size = getattr(args, "micro_batch_size", DEFAULT_MICRO_BATCH_SIZE)
    if args.task == "WIKITEXT103":
        return evaluate_wikitext(model, tokenizer, path, seq_length, args.overlapping_eval, batch_size)
    if args.task == "LAMBADA":
        return evaluate_lambada(model, tokenizer, path, seq_length, args.strict_lambada, batch_size)
    if args.task == "RETRO-QA":
        return evaluate_qa(model, tokenizer, path, args.ft_neighbours, args.out_seq_length, batch_size)
    return validation_perplexity(
        model, path, seq_length, args.overlapping_eval, batch_size, args.max_eval_tokens
    )


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.task in FINETUNE_TASKS:
        try:
            metrics = run_finetune(args)
        except USER_ERRORS as error:  # TaskDataError is a ValueError
            parser.error(str(error))
        if args.results_json:
            atomic_write_text(args.results_json, json.dumps(metrics, indent=2))
        return metrics
    if getattr(args, "load", None) is None or not args.valid_data:
        parser.error(f"--task {args.task} evaluates a GPT checkpoint: pass --load and --valid-data")
    multi_rank = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if multi_rank and args.task == "RETRO-QA":
        parser.error(
            "--task RETRO-QA runs in one process (generation with retrieval): start it without torchrun"
        )
    created_group = False
    try:
        try:
            if multi_rank:  # each rank holds its TP slice of its pipeline stage; replicas share the data
                created_group = start_model_parallel(args, data_parallel=True)
            # a Retro checkpoint with --retro-project-dir retrieves as it generates (its inference hook)
            model, tokenizer, config = load_for_inference(args, device=get_device())
        except USER_ERRORS as error:
            parser.error(str(error))
        result = run_task(args, model, tokenizer, config)
    finally:
        state.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()
    metrics = {
        "task": args.task,
        "valid_data": args.valid_data[0],
        "load": args.load,
        **dataclasses.asdict(result),
    }
    if hasattr(result, "accuracy"):
        metrics["accuracy"] = result.accuracy
    if is_reporting_rank():
        line = result.megatron_line(args.task)
        print("-" * (len(line) + 1))
        print(line)
        print("-" * (len(line) + 1))
        if args.results_json:
            atomic_write_text(args.results_json, json.dumps(metrics, indent=2))
    return metrics


if __name__ == "__main__":
    main()
