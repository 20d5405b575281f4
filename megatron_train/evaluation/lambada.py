"""LAMBADA cloze accuracy as Megatron's tasks/zeroshot_gpt computes it.

Each example is the last word of a passage: an example counts as correct when greedy decoding (the argmax at
each target position, teacher-forced) reproduces every token of that word. Without `strict` the target is
just the last token of the passage; with `strict` (Megatron's --strict-lambada) it is the whole last word,
tokenized with its leading space.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from tqdm import tqdm

from megatron_train.evaluation.ranks import data_parallel_share, is_reporting_rank, sum_over_replicas
from megatron_train.inference.forward import forward_step
from megatron_train.tokenizer.base import MegatronTokenizer


def split_last_word(tokenizer: MegatronTokenizer, text: str, strict: bool) -> tuple[list[int], list[int]]:
    """(context ids, target ids) of one passage."""
    if not strict:
        tokens = tokenizer.tokenize(text)
        return tokens[:-1], tokens[-1:]
    last_word = text.split()[-1]
    start = text.rfind(last_word)
    return tokenizer.tokenize(text[:start].strip()), tokenizer.tokenize(" " + last_word)


def load_lambada(path: str, tokenizer: MegatronTokenizer, strict: bool) -> list[tuple[list[int], list[int]]]:
    """The examples of a LAMBADA JSONL file (one {"text": ...} object per line)."""
    examples = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(
                    f'{path}:{line_number}: expected a JSON object with a "text" field ({error})'
                ) from None
            if not isinstance(text, str) or len(text.split()) < 2:
                raise ValueError(f"{path}:{line_number}: the text needs at least two words, got {text!r}")
            examples.append(split_last_word(tokenizer, text, strict))
    if not examples:
        raise ValueError(f"{path}: no examples found")
    return examples


@dataclass
class LambadaResult:
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total

    def megatron_line(self, task: str = "LAMBADA") -> str:
        return (
            f" validation results on {task} | number correct: {float(self.correct):.4E} | "
            f"total examples: {float(self.total):.4E} | avg accuracy: {self.accuracy:.4E}"
        )


@torch.inference_mode()
def count_correct(
    model: torch.nn.Module,
    examples: list[tuple[list[int], list[int]]],
    seq_length: int,
    vocab_size: int,
    pad_id: int,
    micro_batch_size: int = 8,
) -> int:
    """How many examples' targets are all the argmax at their positions (context cut to fit seq_length).
    Under torchrun each data-parallel replica counts its share (`evaluation.ranks`); every rank returns the total."""
    model.eval()
    device = next(model.parameters()).device
    share = [examples[index] for index in data_parallel_share(len(examples))]
    correct = 0
    batch_starts = range(0, len(share), micro_batch_size)
    for first in tqdm(batch_starts, desc="lambada", unit="batch", disable=not is_reporting_rank()):
        batch = [
            (context + target)[-(seq_length + 1) :]
            for context, target in share[first : first + micro_batch_size]
        ]
        targets = [target for _, target in share[first : first + micro_batch_size]]
        width = max(len(ids) for ids in batch) - 1
        ids = torch.full((len(batch), width + 1), pad_id, dtype=torch.long)
        for row, sequence in enumerate(batch):
            ids[row, : len(sequence)] = torch.tensor(sequence)
        ids = ids.to(device)
        position_ids = torch.arange(width, device=device).expand(len(batch), -1)
        logits = forward_step(model, ids[:, :-1], position_ids, None)
        if logits is None:  # not the last pipeline stage
            continue
        predictions = logits[..., :vocab_size].argmax(-1).cpu()
        for row, (sequence, target) in enumerate(zip(batch, targets, strict=True)):
            end = len(sequence) - 1
            correct += predictions[row, end - len(target) : end].tolist() == target
    (total,) = sum_over_replicas([correct])
    return int(total)


def evaluate_lambada(
    model: torch.nn.Module,
    tokenizer: MegatronTokenizer,
    path: str,
    seq_length: int,
    strict: bool = False,
    micro_batch_size: int = 8,
) -> LambadaResult:
    """Megatron's LAMBADA task on `path`."""
    examples = load_lambada(path, tokenizer, strict)
    correct = count_correct(
        model, examples, seq_length, tokenizer.vocab_size, tokenizer.eod, micro_batch_size
    )
    return LambadaResult(correct=correct, total=len(examples))
