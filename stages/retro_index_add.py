"""The Retro index-add stage: the trained index filled with every chunk's embedding (id = chunk id).

Inputs: the `retro_embed` and `retro_index_train` artifacts. One task per embedding block encodes it with the
trained index (`sa_encode`) and commits the codes as one shard (`codes/<start>-<end>.npy`), so a killed fill
encodes only the blocks not committed yet; then the codes are added in chunk order (`retro.index.add_codes`)
and `added.faissindex` is written. See docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import functools
import os
import time

import faiss
import numpy as np

from retro.index import ADDED_INDEX, TRAINED_INDEX, add_codes, require_block_encoding, write_index
from stages.base import Inputs, Stage, expect_inputs
from stages.retro_embed import block_file, block_name, embedding_blocks
from stages.retro_params import IndexAddParams
from stages.shards import MapShards, process_pool, read_committed_npy, run_shards
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter

CODES_DIR = "codes"


def codes_file(start: int, end: int) -> str:
    return f"{CODES_DIR}/{block_name(start, end)}.npy"


@functools.cache
def worker_index(path: str) -> faiss.Index:
    """The trained index, read once per worker process."""
    return faiss.read_index(path)


def encode_block(writer: ArtifactWriter, trained_path: str, vectors_path: str, start: int, end: int) -> dict:
    """Encode one block of embeddings and commit its codes as one shard."""
    codes = worker_index(trained_path).sa_encode(np.load(vectors_path))
    local = os.path.join(writer.local_dir, codes_file(start, end))
    os.makedirs(os.path.dirname(local), exist_ok=True)
    np.save(local, codes, allow_pickle=False)
    writer.commit_shard(block_name(start, end), {codes_file(start, end): local})
    return {"chunks": end - start}


class RetroIndexAddStage(Stage):
    name = "retro_index_add"
    version = "1"
    libraries = ("faiss-cpu", "numpy")
    Params = IndexAddParams
    maps_shards = True

    def key_params(self, params: IndexAddParams) -> dict:
        return {}  # only the worker count: the output depends on the inputs alone

    def run(
        self,
        params: IndexAddParams,
        inputs: Inputs,
        store: ArtifactStore,
        map_shards: MapShards | None = None,
    ) -> ArtifactRef:
        """Fill the trained index; inputs: the `retro_embed` and `retro_index_train` artifacts."""
        embed, trained = expect_inputs(self, inputs, 2, "the retro_embed and retro_index_train artifacts")
        map_shards = map_shards or process_pool(params.workers)

        def build(writer: ArtifactWriter) -> dict:
            started = time.time()
            trained_path = trained.local_path(TRAINED_INDEX)
            index = faiss.read_index(trained_path)
            require_block_encoding(index, trained.manifest()["params"]["index_str"])
            blocks = embedding_blocks(embed)
            args = [
                (writer, trained_path, embed.local_path(block_file(start, end)), start, end)
                for start, end in blocks
            ]
            run_shards(writer, encode_block, args, [block_name(s, e) for s, e in blocks], map_shards)
            add_codes(index, (read_committed_npy(writer, codes_file(s, e)) for s, e in blocks))
            path = os.path.join(writer.local_dir, ADDED_INDEX)
            write_index(index, path)
            writer.commit_shard("added", {ADDED_INDEX: path})
            return {"summary": {"chunks": int(index.ntotal), "seconds": round(time.time() - started, 3)}}

        return self.build_artifact(params, inputs, store, build)


STAGE = RetroIndexAddStage()
run = STAGE.run
key = STAGE.key
