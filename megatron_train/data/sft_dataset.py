"""Supervised finetuning data (`pretrain_gpt --sft`): JSONL conversations, the loss on the assistant's tokens only.

Each line of a file is {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}, as in
Megatron's SFTDataset. A conversation is rendered with the tokenizer's chat template
(`megatron_train.tokenizer.chat.ChatFormat`) and tokenized once; a sample is `seq_length + 1` tokens cut into
tokens and labels as GPTDataset does, with `loss_mask` 1 exactly where the label is a token the assistant wrote
(system and user turns, template scaffolding and padding are 0). One conversation per sample, cut at
`seq_length + 1` tokens and padded (the tokenizer's pad token, else its end-of-document); with `--sft-pack`
consecutive conversations share a sample until it is full, each with position ids from 0 and attending to
itself only (`document_ids`: Megatron-Core's packed sequences), so a conversation's loss does not depend on what
it was packed with. Samples are visited in a
seeded permutation per epoch, so a run is deterministic (docs/architecture.md, SFT).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from megatron_train.data.config import DataConfig, parse_split, split_bounds, split_matrix
from megatron_train.tokenizer.base import MegatronTokenizer
from megatron_train.tokenizer.chat import ROLES, ChatFormat
from storage.documents import read_json_records

logger = logging.getLogger(__name__)

Conversation = tuple[np.ndarray, np.ndarray]  # token ids (int64), assistant mask (bool)


def read_conversations(path: str) -> list[tuple[int, list[dict[str, str]]]]:
    """(line, messages) of every conversation in a JSONL file; a bad record is an error naming the file, the
    line and the field."""
    conversations = []
    for line, where, record in read_json_records(path):
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
        for index, message in enumerate(messages):
            field = f"messages[{index}]"
            if not isinstance(message, dict):
                raise ValueError(f"{where}: {field} is not an object")
            if message.get("role") not in ROLES:
                raise ValueError(f"{where}: {field}.role is {message.get('role')!r}, not one of {ROLES}")
            if not isinstance(message.get("content"), str):
                raise ValueError(f"{where}: {field}.content is not a string")
        if not any(message["role"] == "assistant" for message in messages):
            raise ValueError(f"{where}: messages has no assistant turn, so nothing to learn from")
        conversations.append((line, messages))
    return conversations


def tokenize_conversations(paths: list[str], chat: ChatFormat) -> list[Conversation]:
    """Every conversation of `paths`, in order, tokenized with its assistant mask."""
    tokenized = []
    for path in paths:
        for line, messages in read_conversations(path):
            try:
                tokens, assistant = chat.tokenize(messages)
            except ValueError as error:
                raise ValueError(f"{path}:{line}: {error}") from None
            tokenized.append((np.asarray(tokens, dtype=np.int64), np.asarray(assistant, dtype=bool)))
    return tokenized


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Consecutive conversations grouped while their tokens fit in `capacity` (a longer one stays alone)."""
    groups: list[list[int]] = []
    used = capacity
    for index, length in enumerate(lengths):
        if used + length > capacity:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += length
    return groups


class SFTDataset(torch.utils.data.Dataset):
    """`num_samples` samples (None: one epoch) of `seq_length` tokens from tokenized conversations."""

    def __init__(
        self,
        conversations: list[Conversation],
        seq_length: int,
        pad_id: int,
        seed: int,
        num_samples: int | None = None,
        packed: bool = False,
    ) -> None:
        if not conversations:
            raise ValueError("SFTDataset needs at least one conversation")
        self.conversations, self.seq_length, self.pad_id, self.seed = conversations, seq_length, pad_id, seed
        capacity = seq_length + 1
        lengths = [len(tokens) for tokens, _ in conversations]
        self.packed = packed
        self.samples = pack(lengths, capacity) if packed else [[index] for index in range(len(lengths))]
        self.num_samples = len(self.samples) if num_samples is None else num_samples
        truncated = sum(length > capacity for length in lengths)
        if truncated:
            logger.warning("%d of %d conversations are longer than --seq-length + 1 = %d tokens and are cut",
                           truncated, len(lengths), capacity)  # fmt: skip

    def __len__(self) -> int:
        return self.num_samples

    def _sample(self, idx: int) -> list[int]:
        epoch, within = divmod(idx, len(self.samples))
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.samples))
        return self.samples[order[within]]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        capacity = self.seq_length + 1
        tokens = np.full(capacity, self.pad_id, dtype=np.int64)
        assistant = np.zeros(capacity, dtype=bool)
        positions = np.arange(capacity, dtype=np.int64)
        documents = np.zeros(capacity, dtype=np.int64)
        start = 0
        for number, index in enumerate(self._sample(idx)):
            conversation_tokens, conversation_mask = self.conversations[index]
            length = min(len(conversation_tokens), capacity - start)
            tokens[start : start + length] = conversation_tokens[:length]
            assistant[start : start + length] = conversation_mask[:length]
            positions[start:] = np.arange(capacity - start)
            documents[start:] = number  # the padding after the last conversation is its own
            start += length
        documents[start:] += 1
        sample = {
            "tokens": tokens[:-1],
            "labels": tokens[1:],
            "loss_mask": assistant[1:].astype(np.float32),
            "position_ids": positions[:-1],
        }
        if self.packed:
            sample["document_ids"] = documents[:-1]
        return sample


def _pad_id(tokenizer: MegatronTokenizer) -> int:
    for name in ("pad", "eod"):
        try:
            token_id = getattr(tokenizer, name)
        except NotImplementedError:
            continue
        if token_id is not None and token_id >= 0:
            return token_id
    return 0  # never in the loss: padding is masked


def build_sft_datasets(
    data_config: DataConfig,
    tokenizer: MegatronTokenizer,
    seq_length: int,
    num_samples: tuple[int | None, int | None, int | None],
    seed: int,
) -> tuple[SFTDataset | None, SFTDataset | None, SFTDataset | None]:
    """(train, valid, test) SFT datasets: `--data-path` files cut into splits by `--split` (by conversation),
    or `--train-data-path` / `--valid-data-path` / `--test-data-path` files used whole."""
    chat = ChatFormat(tokenizer, data_config.sft_tokenizer_prompt_format)
    blends = data_config.blends()
    if any(blend is not None and blend.weights is not None for blend in blends):
        raise ValueError("--sft reads whole JSONL files: give --data-path file paths without weights")
    if data_config.data_path:
        conversations = tokenize_conversations(blends[0].prefixes, chat)
        ranges = [
            None if bookend is None else split_bounds(bookend, len(conversations))
            for bookend in split_matrix(parse_split(data_config.split))
        ]
        per_split = [None if bounds is None else conversations[slice(*bounds)] for bounds in ranges]
    else:
        per_split = [
            None if blend is None else tokenize_conversations(blend.prefixes, chat) for blend in blends
        ]
    return tuple(
        SFTDataset(split, seq_length, _pad_id(tokenizer), seed, samples, data_config.sft_pack)
        if split and samples != 0
        else None
        for split, samples in zip(per_split, num_samples, strict=True)
    )
