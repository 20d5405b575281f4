"""Generation with retrieval: a Retro model continues a prompt, each step attending to the neighbours retrieved
for the chunks of the text so far from the project's filled index, at request time.

The chunks are the model's own (`megatron_train.models.retro`): a text of ns tokens is l = ceil(ns / m) chunks,
the first holding ns mod m tokens (or m) and the rest whole, so the last chunk ends at the newest token. Each
chunk's text is embedded with the project's embedder and searched in the index (pretraining's neighbour query,
without the own-document exclusion: a prompt belongs to no database document); the first k neighbours'
tokens and continuations are read as `RetroDataset` reads them. Generation reruns the whole sequence each step
(Retro has no KV cache: the chunks move as the text grows). `RetrievingModel` puts model and retriever behind
the GPT call `model(tokens, position_ids=..., kv_cache=None)`, so the generation server and `generate` serve a
Retro checkpoint unchanged. See docs/architecture.md (Retro model).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import faiss
import numpy as np
import torch

from megatron_train.data.retro_dataset import neighbor_tokens
from megatron_train.models.config import TransformerConfig
from megatron_train.models.retro import RetroModel
from megatron_train.tokenizer import MegatronTokenizer
from retro.config import QueryConfig
from retro.db import ChunkDatabase
from retro.index import Embed, embed_texts, load_index
from retro.project import db_dir, index_path


def sequence_chunks(length: int, chunk_length: int) -> list[tuple[int, int]]:
    """[start, end) of the chunks the Retro model cuts a `length`-token text into (a short first chunk)."""
    first = length % chunk_length or chunk_length
    return [(0, min(first, length)), *((s, s + chunk_length) for s in range(first, length, chunk_length))]


class Retriever:
    """Neighbour tokens [l, k, r] of any token sequence, from a chunk database and its filled index."""

    def __init__(
        self,
        db: ChunkDatabase,
        index: faiss.Index,
        embed: Embed,
        gpt_tokenizer: MegatronTokenizer,
        chunk_length: int,
        num_neighbors: int,
        num_retrieved_chunks: int,
    ) -> None:
        self.db = db
        self.index = index
        self.embed = embed
        self.gpt_tokenizer = gpt_tokenizer
        self.chunk_length = chunk_length
        self.num_neighbors = num_neighbors
        self.num_retrieved_chunks = num_retrieved_chunks

    @classmethod
    def from_project(
        cls,
        project_dir: str,
        model: RetroModel,
        embed: Embed,
        gpt_tokenizer: MegatronTokenizer,
        nprobe: int,
        ef_search: int,
    ) -> Retriever:
        """The project's database and filled index (DIR/index/added.faissindex), with the model's Retro shape."""
        retro = model.retro
        index = load_index(index_path(project_dir), nprobe, ef_search)
        return cls(
            ChunkDatabase(db_dir(project_dir)),
            index,
            embed,
            gpt_tokenizer,
            retro.retro_chunk_length,
            retro.retro_num_neighbors,
            retro.retro_num_retrieved_chunks,
        )

    def neighbour_ids(self, tokens: Sequence[int]) -> np.ndarray:
        """int64 [l, k]: the nearest database chunks of each chunk of `tokens`."""
        texts = [
            self.gpt_tokenizer.detokenize(list(tokens[start:end]))
            for start, end in sequence_chunks(len(tokens), self.chunk_length)
        ]
        _, found = self.index.search(embed_texts(self.embed, texts), self.num_neighbors)
        return found.astype(np.int64)

    def __call__(self, tokens: Sequence[int]) -> np.ndarray:
        """int64 [l, k, r]: the neighbour tokens the model attends to for `tokens`."""
        return neighbor_tokens(
            self.db,
            self.neighbour_ids(tokens),
            self.chunk_length,
            self.num_retrieved_chunks,
            self.gpt_tokenizer.eod,
        )


class RetrievingModel(torch.nn.Module):
    """A RetroModel that retrieves its own neighbours: forward(tokens [b, s]) retrieves for each row's text
    and runs the model on it. `supports_kv_cache = False` tells generation to rerun the whole text each step."""

    supports_kv_cache = False

    def __init__(self, model: RetroModel, retriever: Retriever) -> None:
        super().__init__()
        self.model = model
        self.retriever = retriever

    @property
    def config(self) -> TransformerConfig:
        return self.model.config

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, kv_cache: None = None
    ) -> torch.Tensor:
        if kv_cache is not None:
            raise ValueError("a Retro model has no KV cache: generate with use_kv_cache=False")
        neighbours = np.stack([self.retriever(row) for row in input_ids.tolist()])
        return self.model(
            input_ids, position_ids, neighbor_tokens=torch.as_tensor(neighbours, device=input_ids.device)
        )


@torch.no_grad()
def generate_with_retrieval(
    model: RetroModel, retriever: Retriever, prompt: Sequence[int], tokens_to_generate: int
) -> list[int]:
    """Greedy continuation of `prompt` (token ids), retrieving for the whole text before every token; stops
    after `tokens_to_generate` tokens or at the tokenizer's EOD. Returns the new tokens."""
    if not prompt:
        raise ValueError(
            "generation with retrieval needs a non-empty prompt: the first chunk is retrieved for it"
        )
    device = next(model.parameters()).device
    retrieving = RetrievingModel(model, retriever)
    tokens = list(prompt)
    for _ in range(tokens_to_generate):
        logits = retrieving(torch.tensor([tokens], device=device))
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        if token == retriever.gpt_tokenizer.eod:
            break
    return tokens[len(prompt) :]


class RetrievingDataset(torch.utils.data.Dataset):
    """Samples of `dataset` (dicts with "tokens" [seq_length], as `SFTDataset` returns) with the neighbours of
    their chunks retrieved from the project's index, as the server retrieves for a prompt: `pretrain_retro
    --sft` trains a Retro model on instruction data that belongs to no database document (so no own-document
    exclusion). Retrieval runs in `__getitem__`, once per sample read, in whichever DataLoader worker reads it."""

    def __init__(self, dataset: torch.utils.data.Dataset, retriever: Retriever, seq_length: int) -> None:
        if seq_length % retriever.chunk_length:
            raise ValueError(
                f"--seq-length {seq_length} is not a multiple of the Retro chunk length "
                f"{retriever.chunk_length}: Retro training cuts samples into whole chunks"
            )
        self.dataset = dataset
        self.retriever = retriever

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        sample = self.dataset[idx]
        return {**sample, "neighbor_tokens": self.retriever(sample["tokens"].tolist())}


def add_retrieval_flags(parser: argparse.ArgumentParser) -> None:
    """The index's search-time flags of a tool that serves or evaluates a Retro checkpoint."""
    group = parser.add_argument_group("Retro retrieval (with --retro-project-dir)")
    group.add_argument("--retro-query-nprobe", type=int, default=QueryConfig.retro_query_nprobe)
    group.add_argument("--retro-query-ef-search", type=int, default=QueryConfig.retro_query_ef_search)
