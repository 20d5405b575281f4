"""The Retro index-train stage: an empty faiss index (`--retro-index-str`) trained on sampled chunk embeddings.

Inputs: the `retro_db` artifact (the blend's chunk counts, for the sample) and the `retro_embed` artifact (the
vectors: nothing is embedded again). The sample is `retro.index.training_chunk_ids` (seeded, by blend weight,
then the load fraction). Output: `trained.faissindex`. See docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import os

from retro.db import ChunkDatabase
from retro.index import TRAINED_INDEX, build_trained_index, training_chunk_ids, write_index
from stages.base import Inputs, Stage, expect_inputs
from stages.retro_db import DB_FILES
from stages.retro_embed import load_embeddings
from stages.retro_params import IndexTrainParams, local_dir
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter


class RetroIndexTrainStage(Stage):
    name = "retro_index_train"
    version = "1"
    libraries = ("faiss-cpu", "numpy")
    Params = IndexTrainParams

    def run(self, params: IndexTrainParams, inputs: Inputs, store: ArtifactStore) -> ArtifactRef:
        """Train the index; inputs: the `retro_db` and `retro_embed` artifacts."""
        db, embed = expect_inputs(self, inputs, 2, "the retro_db and retro_embed artifacts")
        config = params.config()

        def build(writer: ArtifactWriter) -> dict:
            ids = training_chunk_ids(ChunkDatabase(local_dir(db, list(DB_FILES))), config)  # counts only
            index = build_trained_index(load_embeddings(embed, ids), params.index_str)
            path = os.path.join(writer.local_dir, TRAINED_INDEX)
            write_index(index, path)
            writer.commit_shard("trained", {TRAINED_INDEX: path})
            return {"summary": {"training_chunks": len(ids)}}

        return self.build_artifact(params, inputs, store, build)


STAGE = RetroIndexTrainStage()
run = STAGE.run
key = STAGE.key
