"""The Retro embed stage: every database chunk's embedding, in blocks of `block_size` chunks, one task each.

Inputs: the tokenize artifact (the chunks' tokens) and the `retro_db` artifact. A block is one shard
(`embeddings/<start>-<end>.npy`, float32 [chunks, dim], row = chunk id), mapped with `map_shards` (a local
process pool, or one Prefect task run per block inside a flow) and committed as it finishes, so a killed run
embeds only the blocks not committed yet. Each worker process loads the embedder once
(`worker_embedder`), on the GPU when there is one. See docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import numpy as np
import torch

from retro.blocks import block_ranges
from retro.db import ChunkDatabase
from retro.embedder import BertEmbedder, load_embedder
from retro.index import Embed, embed_chunks
from stages.base import Inputs, Stage, expect_inputs
from stages.retro_db import DB_FILES
from stages.retro_params import EmbedParams, local_dir, token_prefix
from stages.shards import MapShards, process_pool, run_shards
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter

log = logging.getLogger("megatron_flow.stage.retro_embed")

EMBEDDINGS_DIR = "embeddings"


def block_name(start: int, end: int) -> str:
    return f"{start:010d}-{end:010d}"


def block_file(start: int, end: int) -> str:
    return f"{EMBEDDINGS_DIR}/{block_name(start, end)}.npy"


@functools.cache
def worker_embedder(path: str, batch_size: int, device: str | None, workers: int) -> BertEmbedder:
    """One embedder per worker process (loaded on its first block), using its share of the CPU cores
    (`workers` processes embed at once; more torch threads than cores slow every one of them down)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    return load_embedder(path, batch_size, device)


@functools.cache
def worker_database(db_dir: str, prefix: str) -> ChunkDatabase:
    return ChunkDatabase(db_dir, [prefix])


def embed_block(
    writer: ArtifactWriter, params: EmbedParams, db_dir: str, prefix: str, start: int, end: int
) -> dict:
    """Embed chunks [start, end) and commit them as one shard."""
    embed: Embed = worker_embedder(params.embedder_path(), params.batch_size, params.device, params.workers)
    vectors = embed_chunks(
        worker_database(db_dir, prefix), np.arange(start, end), embed, params.gpt_tokenizer()
    )
    local = os.path.join(writer.local_dir, block_file(start, end))
    os.makedirs(os.path.dirname(local), exist_ok=True)
    np.save(local, vectors, allow_pickle=False)
    writer.commit_shard(block_name(start, end), {block_file(start, end): local})
    return {"chunks": end - start}


def load_embeddings(embed: ArtifactRef, chunk_ids: np.ndarray) -> np.ndarray:
    """float32 [len(chunk_ids), dim]: the embeddings of the given (sorted) chunk ids from the committed blocks."""
    manifest = embed.manifest()
    parts = []
    for start, end in block_ranges(manifest["summary"]["chunks"], manifest["block_size"]):
        wanted = chunk_ids[(chunk_ids >= start) & (chunk_ids < end)]
        if len(wanted):
            block = np.load(embed.local_path(block_file(start, end)), mmap_mode="r")
            parts.append(np.asarray(block[wanted - start]))
    return np.concatenate(parts)


def embedding_blocks(embed: ArtifactRef) -> list[tuple[int, int]]:
    """The [start, end) chunk ranges of an embed artifact's blocks."""
    manifest = embed.manifest()
    return block_ranges(manifest["summary"]["chunks"], manifest["block_size"])


class RetroEmbedStage(Stage):
    name = "retro_embed"
    version = "1"
    libraries = ("torch",)
    Params = EmbedParams
    maps_shards = True

    def key_params(self, params: EmbedParams) -> dict:
        return params.key_fields()

    def run(
        self, params: EmbedParams, inputs: Inputs, store: ArtifactStore, map_shards: MapShards | None = None
    ) -> ArtifactRef:
        """Embed every chunk of the database; inputs: the tokenize and `retro_db` artifacts."""
        tokenize, db = expect_inputs(self, inputs, 2, "the tokenize and retro_db artifacts")
        map_shards = map_shards or process_pool(params.workers)

        def build(writer: ArtifactWriter) -> dict:
            started = time.time()
            db_dir, prefix = local_dir(db, list(DB_FILES)), token_prefix(tokenize)
            total = len(ChunkDatabase(db_dir, [prefix]))
            blocks = block_ranges(total, params.block_size)
            names = [block_name(start, end) for start, end in blocks]
            args = [(writer, params, db_dir, prefix, start, end) for start, end in blocks]
            run_shards(writer, embed_block, args, names, map_shards)
            seconds = time.time() - started
            log.info("retro embed: %d chunks in %d blocks, %.1f s", total, len(blocks), seconds)
            return {"summary": {"chunks": total, "blocks": len(blocks)}, "block_size": params.block_size}

        return self.build_artifact(params, inputs, store, build)


STAGE = RetroEmbedStage()
run = STAGE.run
key = STAGE.key
