"""Finetune BERT on RACE, MNLI or QQP and print the accuracy on every validation set after each epoch, as
Megatron's tasks/finetune_utils.py and tasks/eval_utils.py, on the training engine's own pieces: the run's
set-up (DDP, optimizer, scheduler with --lr-warmup-fraction, --load of a finetuned run), `Trainer` for the
steps, log lines, checkpoints and exit conditions, and the pretrained BERT loaded as `model.load_pretrained_bert`.

Settings: the model's shape and tokenizer come from --pretrained-checkpoint (or the finetuned --load), and a
model flag on the command line must agree with it; the rest are Megatron's training flags. One micro-batch
per step (the global batch is --micro-batch-size x data-parallel size), as Megatron's finetuning requires.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_train.arguments import SECTIONS, MegatronConfig, config_from_dict, validate_config
from megatron_train.checkpointing import read_metadata, resolve_iteration_dir
from megatron_train.device import get_device
from megatron_train.inference.checkpoint import check_model_flags, check_tokenizer_fits, tokenizer_for
from megatron_train.parallel import state
from megatron_train.tasks.finetune.glue import glue_split_name, read_mnli, read_qqp
from megatron_train.tasks.finetune.hf import DEFAULT_SPLITS, hf_records
from megatron_train.tasks.finetune.model import (
    BERT_CLASSIFIER,
    check_bert_checkpoint,
    forward_step,
    load_pretrained_bert,
)
from megatron_train.tasks.finetune.race import NUM_CHOICES, race_split_name, read_race
from megatron_train.tasks.finetune.samples import build_samples
from megatron_train.tokenizer import MegatronTokenizer, tokenizer_from_config
from megatron_train.training.entry import padded_vocab_size_for
from megatron_train.training.loop import Trainer, build_metrics_writer
from megatron_train.training.setup import model_parallel_session, set_random_seed, setup_model_and_optimizer


@dataclass(frozen=True)
class Task:
    """A downstream task: logits per sequence (1 for multiple choice), its file reader, its split names."""

    num_classes: int
    read_file: Callable[[str], list]
    split_name: Callable[[str], str]
    sequences_per_sample: int = 1  # RACE: a question is one sequence per option


TASKS = {
    "MNLI": Task(3, read_mnli, glue_split_name),
    "QQP": Task(2, read_qqp, glue_split_name),
    "RACE": Task(1, read_race, race_split_name, sequences_per_sample=NUM_CHOICES),
}


def add_finetune_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("finetuning (RACE, MNLI, QQP)")
    group.add_argument(
        "--epochs", type=int, default=None, help="Passes over --train-data (0: evaluate only)."
    )
    group.add_argument(
        "--train-data",
        nargs="+",
        default=None,
        help="GLUE .tsv files (MNLI, QQP) or RACE folders (RACE/train/middle RACE/train/high).",
    )
    group.add_argument(
        "--pretrained-checkpoint",
        default=None,
        help="The --save folder of a pretrain_bert run to start from.",
    )
    group.add_argument(
        "--hf-dataset",
        default=None,
        help="Read the task from a Hugging Face dataset instead of files: a save_to_disk folder or a cached "
        "hub name (glue/mnli, glue/qqp, race/all).",
    )
    group.add_argument("--hf-train-split", default=None, help="Default: train.")
    group.add_argument(
        "--hf-valid-splits",
        nargs="+",
        default=None,
        help="Default: validation_matched validation_mismatched (MNLI), validation (QQP, RACE).",
    )
    group.add_argument(
        "--keep-last",
        action="store_true",
        help="Train on each epoch's last, incomplete global batch too (shared out over the data-parallel ranks, "
        "padded from the epoch's first samples as torch's DistributedSampler pads); default: dropped.",
    )


@dataclass
class TaskData:
    """Tokenized samples: the training set, and each validation set under its name."""

    train: list[dict]
    valid: list[tuple[str, list[dict]]]


def read_task_data(args: argparse.Namespace, tokenizer: MegatronTokenizer, seq_length: int) -> TaskData:
    task = TASKS[args.task]
    training = bool(args.epochs)
    if args.hf_dataset is not None:
        train_split, valid_splits = DEFAULT_SPLITS[args.task]
        train_split = args.hf_train_split or train_split
        valid_splits = args.hf_valid_splits or list(valid_splits)
        records = hf_records(
            args.task, args.hf_dataset, [*([train_split] if training else []), *valid_splits]
        )
        train = records[train_split] if training else []
        valid = [(split, records[split]) for split in valid_splits]
    else:
        if training and not args.train_data:
            raise ValueError(
                f"--task {args.task} --epochs {args.epochs} needs --train-data (or --hf-dataset)"
            )
        if not args.valid_data:
            raise ValueError(f"--task {args.task} needs --valid-data (or --hf-dataset)")
        train = (
            [record for path in (args.train_data or []) for record in task.read_file(path)]
            if training
            else []
        )
        valid = [(task.split_name(path), task.read_file(path)) for path in args.valid_data]
    return TaskData(
        build_samples(train, tokenizer, seq_length),
        [(name, build_samples(records, tokenizer, seq_length)) for name, records in valid],
    )


def saved_config(args: argparse.Namespace) -> tuple[MegatronConfig | None, str | None]:
    """The config of the checkpoint the model comes from: the finetuned run's (--load) when it has one, else
    --pretrained-checkpoint's; (None, None) when neither exists (the model flags then decide)."""
    for folder in (getattr(args, "load", None), args.pretrained_checkpoint):
        iteration_dir = resolve_iteration_dir(folder, None) if folder else None
        if iteration_dir is not None:
            metadata = read_metadata(iteration_dir)
            check_bert_checkpoint(metadata, iteration_dir)
            return config_from_dict(metadata["args"]), iteration_dir
    if args.pretrained_checkpoint:
        raise ValueError(
            f"--pretrained-checkpoint {args.pretrained_checkpoint}: no checkpoint there (no "
            "latest_checkpointed_iteration.txt); pass the --save folder of a pretrain_bert run"
        )
    return None, None


# Model fields that say how this run computes, not what the weights are: never taken from the checkpoint.
RUN_SETTINGS = (
    "fp16", "bf16", "use_flash_attn", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "recompute_activations",
)  # fmt: skip


def finetune_config(args: argparse.Namespace, saved: MegatronConfig | None) -> MegatronConfig:
    """Megatron's sections from the flags given; the model (but its `RUN_SETTINGS`) and tokenizer sections
    start from `saved`'s."""
    given = vars(args)
    sections = {}
    for name, cls in SECTIONS.items():
        values = {}
        if saved is not None and name in ("model", "tokenizer"):
            values = {
                k: v for k, v in dataclasses.asdict(getattr(saved, name)).items() if k not in RUN_SETTINGS
            }
        values |= {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}
        try:
            sections[name] = cls(**values)
        except TypeError as error:
            raise ValueError(
                f"{error}: without --pretrained-checkpoint the model flags (--num-layers, --hidden-size, "
                "--num-attention-heads, ...) are needed"
            ) from None
    return MegatronConfig(**sections)


def steps_per_epoch(num_train: int, global_batch: int, keep_last: bool) -> int:
    """Global batches in one pass over the training set: the incomplete last one counts with --keep-last."""
    full, rest = divmod(num_train, global_batch)
    return full + int(keep_last and rest > 0)


def set_schedule(
    config: MegatronConfig, epochs: int, num_train: int, world_size: int, keep_last: bool
) -> int:
    """One micro-batch per step: --global-batch-size is --micro-batch-size x DP; --train-iters is the epochs'
    steps. Returns the steps per epoch."""
    training = config.training
    BERT_CLASSIFIER.layouts.check(BERT_CLASSIFIER.name, config)
    global_batch = training.micro_batch_size * config.parallel.data_parallel_size(world_size)
    if training.global_batch_size not in (None, global_batch):
        raise ValueError(
            f"--global-batch-size {training.global_batch_size}: finetuning takes one micro-batch per step, so the "
            f"global batch is --micro-batch-size x data-parallel size = {global_batch}; drop the flag"
        )
    training.global_batch_size = global_batch
    steps = steps_per_epoch(num_train, global_batch, keep_last)
    if epochs and not steps:
        raise ValueError(
            f"{num_train} training samples are fewer than one global batch of {global_batch}: pass --keep-last "
            "to train on them, or lower --micro-batch-size"
        )
    training.train_samples = None
    training.train_iters = epochs * steps
    if not epochs:  # evaluation only: nothing steps, but the scheduler needs a length and a rate
        training.train_iters = 1
        config.optimizer.lr = config.optimizer.lr or 0.0
        config.checkpoint.no_load_optim = True  # a finetuned --load gives its weights, not its optimizer
    return steps


def collate(samples: list[dict]) -> dict[str, np.ndarray]:
    return {key: np.stack([np.asarray(sample[key]) for sample in samples]) for key in samples[0]}


def train_batches(
    samples: list[dict],
    global_batch: int,
    micro_batch: int,
    data_parallel: tuple[int, int],
    seed: int,
    start: int,
    keep_last: bool = False,
) -> Iterator[dict[str, np.ndarray]]:
    """This DP rank's micro-batch of every step from step `start` on: each epoch a permutation of the training
    set seeded `seed + epoch` (as Megatron's sampler epochs) cut into global batches; DP rank r takes the r-th
    micro-batch of each global batch, so any DP size sees the same full batches. The incomplete last batch is
    dropped, or with `keep_last` padded with the permutation's first samples to a multiple of the DP size and
    shared out evenly (every rank steps on as many samples)."""
    dp_rank, dp_size = data_parallel
    full, rest = divmod(len(samples), global_batch)
    per_epoch = steps_per_epoch(len(samples), global_batch, keep_last)
    epoch, order = None, None
    for step in itertools.count(start):
        if step // per_epoch != epoch:
            epoch = step // per_epoch
            order = np.random.default_rng(seed + epoch).permutation(len(samples))
        index = step % per_epoch
        if index < full:
            first = index * global_batch + dp_rank * micro_batch
            chosen = order[first : first + micro_batch]
        else:
            per_rank = -(-rest // dp_size)
            tail = np.concatenate([order[full * global_batch :], order[: per_rank * dp_size - rest]])
            chosen = tail[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        yield collate([samples[i] for i in chosen])


@torch.no_grad()
def correct_answers(model: torch.nn.Module, samples: list[dict], micro_batch: int) -> tuple[int, int]:
    """(correct, total) over the whole set: DP rank r scores samples r, r + DP, ...; counts summed over DP."""
    dp_rank, dp_size = state.get_data_parallel_rank(), state.get_data_parallel_world_size()
    mine = samples[dp_rank::dp_size]
    correct = 0
    for first in range(0, len(mine), micro_batch):
        batch = {
            key: torch.as_tensor(value).to(get_device())
            for key, value in collate(mine[first : first + micro_batch]).items()
        }
        logits = model(batch["text"], batch["padding_mask"], batch["types"])
        correct += int((logits.argmax(dim=-1) == batch["label"]).sum())
    counts = torch.tensor([correct, len(mine)], dtype=torch.long, device=get_device())
    if dp_size > 1:
        dist.all_reduce(counts, group=state.get_data_parallel_group())
    return int(counts[0]), int(counts[1])


def accuracy_line(
    epoch: int, name: str | None, correct: int, total: int, seconds: float | None = None
) -> str:
    """Megatron's eval_utils lines: per validation set, then ` >> ... overall`."""
    percent = 100.0 * correct / max(total, 1)
    if name is None:
        return f" >> |epoch: {epoch}| overall: correct / total = {correct} / {total} = {percent:.4f} %"
    return (
        f" > |epoch: {epoch}| metrics for {name}: correct / total = {correct} / {total} = {percent:.4f} %, "
        f"elapsed time (sec): {seconds:.3f}"
    )


def evaluate_accuracy(model: list[torch.nn.Module], data: TaskData, micro_batch: int, epoch: int) -> dict:
    """Every validation set's accuracy, printed in Megatron's shape on the last rank; model back in train mode."""
    for chunk in model:
        chunk.eval()
    logging_rank = dist.get_rank() == dist.get_world_size() - 1
    if logging_rank:
        print("calculating metrics ...", flush=True)
    results, correct, total = {}, 0, 0
    for name, samples in data.valid:
        start = time.perf_counter()
        right, count = correct_answers(model[0], samples, micro_batch)
        results[name] = {"correct": right, "total": count, "accuracy": right / max(count, 1)}
        correct, total = correct + right, total + count
        if logging_rank:
            print(accuracy_line(epoch, name, right, count, time.perf_counter() - start), flush=True)
    if logging_rank:
        print(accuracy_line(epoch, None, correct, total), flush=True)
    for chunk in model:
        chunk.train()
    return {"epoch": epoch, "splits": results, "overall": correct / max(total, 1)}


def prepare_finetune(args: argparse.Namespace) -> tuple[MegatronConfig, int, TaskData, int]:
    """(validated config, padded vocabulary size, tokenized data, steps per epoch), before any process group:
    every flag, file and checkpoint problem is reported first."""
    saved, where = saved_config(args)
    if saved is not None:
        check_model_flags(args, saved, where)
    config = finetune_config(args, saved)
    if saved is not None:
        tokenizer = tokenizer_for(saved, args, where)
        check_tokenizer_fits(tokenizer, read_metadata(where), where)
    else:
        tokenizer = tokenizer_from_config(config.tokenizer)
    padded_vocab_size = padded_vocab_size_for(config, tokenizer)
    data = read_task_data(args, tokenizer, config.model.seq_length)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    epochs = args.epochs or 0
    steps = set_schedule(config, epochs, len(data.train), world_size, args.keep_last)
    validate_config(config, world_size)
    return config, padded_vocab_size, data, steps


def run_finetune(args: argparse.Namespace) -> dict:
    """Finetune (or, with --epochs 0, only evaluate) as the flags say; returns the accuracies of each epoch."""
    config, padded_vocab_size, data, epoch_steps = prepare_finetune(args)
    epochs = args.epochs or 0
    with model_parallel_session(config, pipeline_size=1, virtual_pipeline_size=None):
        writer = None
        try:
            set_random_seed(config.training.seed)
            num_classes = TASKS[args.task].num_classes
            model_provider = functools.partial(BERT_CLASSIFIER.model_provider, num_classes=num_classes)
            setup = setup_model_and_optimizer(config, model_provider, padded_vocab_size, get_device())
            if setup.loaded.iteration == 0 and args.pretrained_checkpoint:
                load_pretrained_bert(
                    setup.unwrapped_model[0], args.pretrained_checkpoint, config, padded_vocab_size
                )
                setup.optimizer.reload_model_params()
            writer = build_metrics_writer(config, setup.loaded.iteration)
            task = TASKS[args.task]
            terms = BERT_CLASSIFIER.terms(config, padded_vocab_size, num_classes=num_classes)
            trainer = Trainer(
                config, setup, forward_step, padded_vocab_size, terms, writer, task.sequences_per_sample
            )
            micro_batch = config.training.micro_batch_size
            results = []
            if epochs == 0:
                results.append(evaluate_accuracy(setup.model, data, micro_batch, epoch=-1))
            batches = train_batches(
                data.train,
                config.training.global_batch_size,
                micro_batch,
                (state.get_data_parallel_rank(), state.get_data_parallel_world_size()),
                config.training.seed,
                trainer.progress.iteration,
                args.keep_last,
            )
            for epoch in range(trainer.progress.iteration // max(epoch_steps, 1), epochs):
                if dist.get_rank() == 0:
                    print(f"working on epoch {epoch + 1} ...", flush=True)
                if trainer.train([batches], None, until=(epoch + 1) * epoch_steps):
                    break  # an exit condition (--exit-interval, SIGTERM): saved, no accuracy for a partial epoch
                trainer.save()
                results.append(evaluate_accuracy(setup.model, data, micro_batch, epoch))
            return {"task": args.task, "iteration": trainer.progress.iteration, "epochs": results}
        finally:
            if writer is not None:
                writer.close()
