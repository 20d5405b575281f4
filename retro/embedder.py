"""Retro's chunk embedder: our `BertModel`, frozen, over chunk texts, one vector per text.

Texts are WordPiece-tokenized (the embedder's vocab.txt), wrapped in [CLS] ... [SEP], cut to `max_seq_length`,
sorted by length so each batch pads little, run through the encoder in eval mode without gradients (on the GPU
when there is one), then pooled:

- a sentence-transformers directory (`modules.json`, e.g. all-MiniLM-L6-v2) says how: mean over every attended
  token, [CLS] and [SEP] included (`1_Pooling/config.json`), then L2 normalisation when a `Normalize` module
  follows, its `max_seq_length` from `sentence_bert_config.json`; so the vectors equal its `encode`;
- any other model (a Hugging Face BERT directory, a Megatron-Flow BERT checkpoint) pools as Megatron's Retro
  embedder (tools/bert_embedding): mean over the non-special tokens, zeros for a text with none, no
  normalisation.

`load_embedder(path)` takes either a Hugging Face BERT-family directory (through `megatron_train.models.hf_bert`)
or a Megatron-Flow checkpoint directory of a BERT run (`--load`). See docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_train.arguments import config_from_dict
from megatron_train.checkpointing import load_model_for_inference
from megatron_train.checkpointing.files import TRACKER_FILENAME, resolve_iteration_dir
from megatron_train.checkpointing.saved import SavedCheckpoint
from megatron_train.device import get_device
from megatron_train.models.bert import BertModel
from megatron_train.models.hf_bert import load_hf_bert
from megatron_train.tokenizer.bert import BertWordPieceTokenizer

SENTENCE_TRANSFORMERS_MODULES = "modules.json"


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector: mean over all attended tokens or over the non-special ones only,
    then L2-normalised or not."""

    include_special_tokens: bool = False  # Megatron's Retro embedder: [CLS] and [SEP] left out
    normalize: bool = False
    max_seq_length: int = 256  # Megatron's --retro-bert-max-chunk-length


def read_pooling(directory: str) -> Pooling:
    """The pooling a model directory asks for: sentence-transformers' modules when present, else Megatron's."""
    modules_path = os.path.join(directory, SENTENCE_TRANSFORMERS_MODULES)
    if not os.path.isfile(modules_path):
        return Pooling()
    with open(modules_path, encoding="utf-8") as f:
        modules = {module["type"].rsplit(".", 1)[-1]: module for module in json.load(f)}
    if "Pooling" not in modules:
        raise ValueError(f"{modules_path}: no Pooling module; the embedder needs mean pooling")
    pooling_path = os.path.join(directory, modules["Pooling"]["path"], "config.json")
    with open(pooling_path, encoding="utf-8") as f:
        pooling = json.load(f)
    modes = sorted(
        k.removeprefix("pooling_mode_") for k, on in pooling.items() if k.startswith("pooling_mode_") and on
    )
    if modes != ["mean_tokens"]:
        raise ValueError(f"{pooling_path}: pooling modes {modes}; the embedder implements mean_tokens only")
    max_seq_length = Pooling.max_seq_length
    bert_config_path = os.path.join(directory, "sentence_bert_config.json")
    if os.path.isfile(bert_config_path):
        with open(bert_config_path, encoding="utf-8") as f:
            max_seq_length = json.load(f).get("max_seq_length", max_seq_length)
    return Pooling(
        include_special_tokens=True, normalize="Normalize" in modules, max_seq_length=max_seq_length
    )


class BertEmbedder:
    """texts -> float32 [len(texts), hidden]: `retro.index.Embed` over a frozen BertModel."""

    def __init__(
        self,
        model: BertModel,
        tokenizer: BertWordPieceTokenizer,
        pooling: Pooling = Pooling(),
        batch_size: int = 128,  # Megatron's --retro-bert-batch-size
        device: torch.device | str | None = None,
    ) -> None:
        self.device = torch.device(device) if device is not None else get_device()
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.batch_size = batch_size
        self.max_seq_length = min(pooling.max_seq_length, model.config.max_position_embeddings)

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """[CLS] pieces [SEP] of each text, the pieces cut to fit `max_seq_length`."""
        keep = self.max_seq_length - 2
        cls, sep = self.tokenizer.cls, self.tokenizer.sep
        return [[cls, *ids[:keep], sep] for ids in self.tokenizer.tokenize_batch(list(texts))]

    @torch.inference_mode()
    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        ids = self.token_ids(texts)
        order = np.argsort([-len(row) for row in ids], kind="stable")  # longest first, as encode does
        vectors = np.zeros((len(ids), self.dim), dtype=np.float32)
        for first in range(0, len(order), self.batch_size):
            rows = order[first : first + self.batch_size]
            vectors[rows] = self._embed_batch([ids[i] for i in rows]).cpu().numpy()
        return vectors

    def _embed_batch(self, batch: list[list[int]]) -> torch.Tensor:
        lengths = torch.tensor([len(row) for row in batch])
        width = int(lengths.max())
        input_ids = torch.full((len(batch), width), self.tokenizer.pad, dtype=torch.long)
        for i, row in enumerate(batch):
            input_ids[i, : len(row)] = torch.tensor(row)
        positions = torch.arange(width)
        attended = positions[None, :] < lengths[:, None]  # [b, s]
        input_ids, attended = input_ids.to(self.device), attended.to(self.device)
        hidden = self.model.encode(input_ids, attended).transpose(0, 1).float()  # [b, s, h]
        pooled = attended.clone()
        if not self.pooling.include_special_tokens:  # drop [CLS] (first) and [SEP] (last attended)
            pooled[:, 0] = False
            pooled[torch.arange(len(batch), device=self.device), lengths.to(self.device) - 1] = False
        weights = pooled.unsqueeze(-1).to(hidden.dtype)
        vectors = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        if self.pooling.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return vectors


def load_embedder(path: str, batch_size: int = 128, device: torch.device | str | None = None) -> BertEmbedder:
    """The embedder in `path`: a Megatron-Flow BERT checkpoint directory (it holds
    latest_checkpointed_iteration.txt; its vocabulary is the run's --vocab-file) or a Hugging Face
    BERT-family directory (config.json, weights, vocab.txt; sentence-transformers pooling when present)."""
    tokenizer = embedder_tokenizer(path)
    if _is_checkpoint(path):
        model, _ = load_model_for_inference(path, device="cpu")
        if not isinstance(model, BertModel):
            raise ValueError(
                f"{path}: a {type(model).__name__} checkpoint; the Retro embedder needs a BERT run"
            )
        return BertEmbedder(model.float(), tokenizer, Pooling(), batch_size, device)
    return BertEmbedder(load_hf_bert(path).model, tokenizer, read_pooling(path), batch_size, device)


def embedder_tokenizer(path: str) -> BertWordPieceTokenizer:
    """The WordPiece tokenizer of the embedder in `path` (see `load_embedder`), without loading its weights."""
    return BertWordPieceTokenizer(*embedder_vocab(path))


def embedder_vocab(path: str) -> tuple[str, bool]:
    """(vocab.txt, lower-case) of the embedder in `path`: a checkpoint's --vocab-file and tokenizer type, or the
    Hugging Face directory's vocab.txt and do_lower_case."""
    if _is_checkpoint(path):
        tokenizer = config_from_dict(
            SavedCheckpoint(resolve_iteration_dir(path, None)).metadata["args"]
        ).tokenizer
        if tokenizer.tokenizer_type not in ("BertWordPieceLowerCase", "BertWordPieceCase"):
            raise ValueError(
                f"{path}: trained with --tokenizer-type {tokenizer.tokenizer_type}; the Retro embedder "
                "needs BertWordPieceLowerCase or BertWordPieceCase"
            )
        return tokenizer.vocab_file, tokenizer.tokenizer_type == "BertWordPieceLowerCase"
    vocab_file = os.path.join(path, "vocab.txt")
    if not os.path.isfile(os.path.join(path, "config.json")) or not os.path.isfile(vocab_file):
        raise FileNotFoundError(
            f"{path}: neither a Megatron-Flow checkpoint ({TRACKER_FILENAME}) nor a Hugging Face BERT "
            "directory (config.json, vocab.txt and weights); pass one of them as the embedder"
        )
    return vocab_file, _lower_case(path)


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRACKER_FILENAME))


def _lower_case(directory: str) -> bool:
    """Whether the Hugging Face tokenizer lower-cases (tokenizer_config.json's do_lower_case; BERT's default)."""
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return True
    with open(path, encoding="utf-8") as f:
        return bool(json.load(f).get("do_lower_case", True))
