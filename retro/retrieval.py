"""Generation with retrieval: a Retro model continues a prompt, each chunk of the text attending to the neighbours
retrieved for the chunk before it from the project's filled index, at request time.

The chunks are the ones the model trained on, cut from the first token (`complete_chunks`): a text of n tokens
has n // m complete chunks, and each is retrieved for once it is complete (embedded with the project's embedder
and searched in the index: pretraining's neighbour query without the own-document exclusion, as a prompt belongs
to no database document); the first k neighbours' tokens and continuations are read as `RetroDataset` reads
them. Retrieval is memoised per chunk text, so a chunk is retrieved for once however often it is read.
`RetrievingModel` puts model and retriever behind the GPT call `model(tokens, position_ids=..., kv_cache=...)`,
so the generation server and `generate` serve a Retro checkpoint unchanged: without a cache it runs the whole
text each step (padded to whole chunks; the chunk being written attends to nothing yet), with one
(`megatron_train.models.retro.RetroKVCache`) it feeds only the new tokens and retrieves only for the chunks they
complete, with the same tokens out (tested). See docs/architecture.md (Retro model).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import faiss
import numpy as np
import torch
import torch.nn.functional as F

from megatron_train.data.retro_dataset import neighbor_tokens
from megatron_train.inference.generation import allocate_kv_cache
from megatron_train.models.config import TransformerConfig
from megatron_train.models.retro import RetroKVCache, RetroModel, completed_chunks
from megatron_train.tokenizer import MegatronTokenizer
from retro.config import QueryConfig
from retro.db import ChunkDatabase
from retro.index import Embed, embed_texts, load_index
from retro.project import db_dir, index_path

MEMOISED_CHUNKS = 4096  # chunk texts whose neighbours a Retriever keeps (a few MB of token ids)


def complete_chunks(length: int, chunk_length: int) -> list[tuple[int, int]]:
    """[start, end) of the complete chunks of a `length`-token text, cut from its first token as in training."""
    return [(start, start + chunk_length) for start in range(0, length - chunk_length + 1, chunk_length)]


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
        self._memo: dict[tuple[int, ...], np.ndarray] = {}

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

    def neighbour_ids(self, chunks: Sequence[Sequence[int]]) -> np.ndarray:
        """int64 [c, k]: the nearest database chunks of each of `chunks` (token ids)."""
        texts = [self.gpt_tokenizer.detokenize(list(chunk)) for chunk in chunks]
        _, found = self.index.search(embed_texts(self.embed, texts), self.num_neighbors)
        return found.astype(np.int64)

    def chunk_neighbours(self, chunks: Sequence[Sequence[int]]) -> np.ndarray:
        """int64 [c, k, r]: the neighbour tokens of each of `chunks`, retrieved once per chunk text."""
        keys = [tuple(int(t) for t in chunk) for chunk in chunks]
        missing = list(dict.fromkeys(key for key in keys if key not in self._memo))
        if missing:
            if len(self._memo) + len(missing) > MEMOISED_CHUNKS:
                self._memo.clear()
            found = neighbor_tokens(
                self.db, self.neighbour_ids(missing), self.chunk_length, self.num_retrieved_chunks,
                self.gpt_tokenizer.eod,
            )  # fmt: skip
            self._memo.update(zip(missing, found, strict=True))
        shape = (0, self.num_neighbors, self.num_retrieved_chunks * self.chunk_length)
        return np.stack([self._memo[key] for key in keys]) if keys else np.zeros(shape, dtype=np.int64)

    def __call__(self, tokens: Sequence[int]) -> np.ndarray:
        """int64 [n // m, k, r]: the neighbour tokens of the complete chunks of `tokens`."""
        chunks = [tokens[start:end] for start, end in complete_chunks(len(tokens), self.chunk_length)]
        return self.chunk_neighbours(chunks)


class RetrievingModel(torch.nn.Module):
    """A RetroModel that retrieves its own neighbours. Without a KV cache, forward(tokens [b, s]) runs the model
    on the rows padded to whole chunks, their complete chunks with their neighbours; with a `RetroKVCache`
    (which generation allocates: `kv_cache_class`), forward(new tokens [b, s]) retrieves for the chunks they
    complete and runs only them. No beam search (its beams would have to reorder the Retro cache)."""

    kv_cache_class = RetroKVCache
    supports_beam_search = False

    def __init__(self, model: RetroModel, retriever: Retriever) -> None:
        super().__init__()
        self.model = model
        self.retriever = retriever

    @property
    def config(self) -> TransformerConfig:
        return self.model.config

    def _neighbours(self, rows: list[list[Sequence[int]]], chunks: int, device: torch.device) -> torch.Tensor:
        """int64 [b, chunks, k, r]: the neighbour tokens of each row's complete chunks, then EOD padding for the
        chunks not complete yet."""
        retriever = self.retriever
        shape = (
            len(rows),
            chunks,
            retriever.num_neighbors,
            retriever.num_retrieved_chunks * retriever.chunk_length,
        )
        neighbours = np.full(shape, retriever.gpt_tokenizer.eod, dtype=np.int64)
        found = retriever.chunk_neighbours([chunk for row in rows for chunk in row])
        complete = len(rows[0])
        neighbours[:, :complete] = found.reshape(len(rows), complete, *shape[2:])
        return torch.as_tensor(neighbours, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: RetroKVCache | None = None,
    ) -> torch.Tensor:
        m = self.retriever.chunk_length
        if kv_cache is not None:
            offset, new = kv_cache.seq_len_offset, input_ids.shape[1]
            previous = kv_cache.tokens
            kv_cache.tokens = input_ids if previous is None else torch.cat((previous, input_ids), 1)
            chunks = completed_chunks(offset, new, m)
            rows = [[row[j * m : (j + 1) * m] for j in chunks] for row in kv_cache.tokens.tolist()]
            neighbours = self._neighbours(rows, len(chunks), input_ids.device)
            return self.model(input_ids, position_ids, neighbor_tokens=neighbours, kv_cache=kv_cache)
        length = input_ids.shape[1]
        chunks = -(-length // m)
        padded = F.pad(input_ids, (0, chunks * m - length), value=self.retriever.gpt_tokenizer.eod)
        rows = [[row[start:end] for start, end in complete_chunks(length, m)] for row in input_ids.tolist()]
        positions = torch.arange(chunks * m, device=input_ids.device).expand_as(padded)
        neighbours = self._neighbours(rows, chunks, input_ids.device)
        return self.model(padded, positions, neighbor_tokens=neighbours)[:, :length]


@torch.no_grad()
def generate_with_retrieval(
    model: RetroModel,
    retriever: Retriever,
    prompt: Sequence[int],
    tokens_to_generate: int,
    use_kv_cache: bool = True,
) -> list[int]:
    """Greedy continuation of `prompt` (token ids), each chunk retrieved for once it is complete; stops after
    `tokens_to_generate` tokens or at the tokenizer's EOD. Returns the new tokens, the same with or without the
    KV cache."""
    if not prompt:
        raise ValueError("generation with retrieval needs a non-empty prompt: the model continues a text")
    device = next(model.parameters()).device
    retrieving = RetrievingModel(model, retriever)
    kv_cache = allocate_kv_cache(retrieving, 1, len(prompt) + tokens_to_generate) if use_kv_cache else None
    tokens, fed = list(prompt), 0
    for _ in range(tokens_to_generate):
        start = fed if kv_cache is not None else 0
        logits = retrieving(torch.tensor([tokens[start:]], device=device), kv_cache=kv_cache)
        fed = len(tokens)
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
