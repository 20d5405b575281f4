"""The Retro chunk database stage: token data (a tokenize artifact) -> `chunks.npy`, `chunks_invalid.npy`,
`datasets.json` (`retro.db`, docs/architecture.md, Retro preprocessing).

Blocks of documents are built in the writer's scratch folder, each committed there as it finishes, so a killed
build resumes at the first missing block; the merged files are committed as the artifact. The database's BERT
tokenizer is the embedder's vocabulary (`vocab.txt` beside its weights, or its run's --vocab-file).
"""

from __future__ import annotations

import logging
import os
import time

from retro.db import DATASETS_FILE, build_chunk_database
from retro.embedder import embedder_tokenizer
from stages.base import Inputs, Stage, expect_inputs
from stages.retro_params import DbParams, token_prefix
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter

log = logging.getLogger("megatron_flow.stage.retro_db")

DB_FILES = ("chunks.npy", "chunks_invalid.npy", DATASETS_FILE)


class RetroDbStage(Stage):
    name = "retro_db"
    version = "1"
    libraries = ("tokenizers", "numpy")
    Params = DbParams

    def key_params(self, params: DbParams) -> dict:
        return params.key_fields()

    def run(self, params: DbParams, inputs: Inputs, store: ArtifactStore) -> ArtifactRef:
        """The chunk database of the one tokenize artifact in `inputs`."""
        (tokenize,) = expect_inputs(self, inputs, 1, "one tokenize artifact")

        def build(writer: ArtifactWriter) -> dict:
            started = time.time()
            db_dir = os.path.join(writer.local_dir, "db")
            config = params.config()
            db = build_chunk_database(
                [token_prefix(tokenize)],
                db_dir,
                config,
                params.gpt_tokenizer(),
                embedder_tokenizer(params.embedder_path()),
            )
            (info,) = db.infos
            writer.commit_shard("db", {name: os.path.join(db_dir, name) for name in DB_FILES})
            counts = {
                "documents": info.n_docs,
                "train_documents": info.n_docs_train,
                "chunks": len(db),
                "invalid_chunks": info.n_chunks_invalid,
                "seconds": round(time.time() - started, 3),
            }
            log.info("retro db: %s", ", ".join(f"{k} {v}" for k, v in counts.items()))
            return {"summary": counts, "chunk_length": params.chunk_length}

        return self.build_artifact(params, inputs, store, build)


STAGE = RetroDbStage()
run = STAGE.run
key = STAGE.key
