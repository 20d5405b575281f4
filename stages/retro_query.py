"""The Retro query stage: the neighbours of every chunk of every pretraining sample, written as the Retro
project directory that `pretrain_retro --retro-project-dir` reads (`retro.project`).

Inputs: the tokenize, `retro_db` and `retro_index_add` artifacts. The samples are the GPT datasets pretraining
builds from the same data, split, seed, sequence length and sample counts (`RetroProject.num_samples`); each
sample chunk is embedded and searched (`retro.query`), in blocks resumed from the writer's scratch folder after
a kill. The artifact is the whole project: `config.json`, `data/` (the token data), the GPT tokenizer files,
`bert/vocab.txt`, `db/` (its datasets.json pointing at `../data`), `index/added.faissindex`,
`query/<split>/` blocks and `embedder/`. On a local store every file but the neighbours and the configs is a
hard link to the input artifacts' file (no copy). See docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import numpy as np

from megatron_train.data import DataConfig, build_train_valid_test_datasets
from retro import project as layout
from retro.db import DATASETS_FILE, ChunkDatabase
from retro.embedder import embedder_vocab, load_embedder
from retro.index import ADDED_INDEX, load_index
from retro.project import RetroProject
from retro.query import SPLIT_NAMES, HeldOutSamples, query_pretraining_neighbours
from stages.base import Inputs, Stage, expect_inputs
from stages.minhash import near_duplicate_groups
from stages.retro_db import DB_FILES
from stages.retro_params import QueryParams, embedder_files, local_dir, token_prefix
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter
from storage.atomic import atomic_copy, atomic_write_text, is_temporary
from storage.indexed_dataset import data_file_path, index_file_path

log = logging.getLogger("megatron_flow.stage.retro_query")

DATA_NAME = "corpus"
BERT_VOCAB = "bert/vocab.txt"
GPT_TOKENIZER_DIR = "gpt"


def held_out_samples(params: QueryParams, database: ChunkDatabase) -> HeldOutSamples | None:
    """The training samples queried as held-out documents (`params.held_out_share`), with the near-duplicate
    groups of each database dataset's documents (GPT-detokenized, MinHash at `params.held_out_jaccard`)."""
    if not params.held_out_share:
        return None
    tokenizer = params.gpt_tokenizer()
    groups = [
        near_duplicate_groups(
            [tokenizer.detokenize(dataset.get(doc).tolist()) for doc in range(len(dataset))],
            params.held_out_jaccard,
        )
        for dataset in database.datasets
    ]
    log.info(
        "retro query: %.0f%% of training samples held out from their near-duplicates (Jaccard >= %s): %s",
        100 * params.held_out_share,
        params.held_out_jaccard,
        " + ".join(f"{len(np.unique(g))} groups of {len(g)} documents" for g in groups),
    )
    return HeldOutSamples(params.held_out_share, params.seed, groups)


def link_or_copy(src: str, dest: str) -> None:
    """`dest` as a hard link to `src` (same file system), else a copy; either appears complete at once."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if os.path.exists(dest):
        os.remove(dest)
    try:
        os.link(src, dest)
    except OSError:
        atomic_copy(src, dest)


def link_tree(src: str, dest: str) -> None:
    """`link_or_copy` of the embedder's files (`embedder_files`) under `src` to `dest`."""
    for name in embedder_files(src):
        link_or_copy(os.path.join(src, name), os.path.join(dest, name))


def project_tokenizer_file(path: str | None) -> str | None:
    """Where the project holds a GPT tokenizer file: gpt/<its name>."""
    return None if path is None else f"{GPT_TOKENIZER_DIR}/{os.path.basename(path)}"


def project_config(
    params: QueryParams, chunk_length: int, neighbour_dirs: dict[str, str | None]
) -> RetroProject:
    """config.json's fields; tokenizer files are named as the project holds them."""
    _, lower_case = embedder_vocab(params.embedder_path())
    return RetroProject(
        retro_gpt_data_path=[DATA_NAME],
        retro_gpt_split=params.split,
        retro_gpt_seq_length=params.seq_length,
        retro_gpt_chunk_length=chunk_length,
        retro_gpt_seed=params.seed,
        retro_gpt_train_samples=params.train_samples,
        retro_gpt_eval_interval=params.eval_interval,
        retro_gpt_eval_iters=params.eval_iters,
        retro_gpt_global_batch_size=params.global_batch_size,
        retro_gpt_tokenizer_type=params.gpt_tokenizer_type,
        retro_bert_tokenizer_type="BertWordPieceLowerCase" if lower_case else "BertWordPieceCase",
        retro_bert_vocab_file=BERT_VOCAB,
        retro_block_size=params.block_size,
        retro_query_num_neighbors_save=params.num_neighbors_save,
        retro_neighbor_dirs=neighbour_dirs,
        retro_gpt_vocab_file=project_tokenizer_file(params.gpt_vocab_file),
        retro_gpt_merge_file=project_tokenizer_file(params.gpt_merge_file),
        retro_gpt_tokenizer_model=project_tokenizer_file(params.gpt_tokenizer_model),
    )


class RetroQueryStage(Stage):
    name = "retro_query"
    version = "1"
    libraries = ("faiss-cpu", "torch")
    Params = QueryParams

    def key_params(self, params: QueryParams) -> dict:
        return params.key_fields()

    def run(self, params: QueryParams, inputs: Inputs, store: ArtifactStore) -> ArtifactRef:
        """Query the neighbours and write the Retro project; inputs: tokenize, `retro_db`, `retro_index_add`."""
        tokenize, db, index = expect_inputs(
            self, inputs, 3, "the tokenize, retro_db and retro_index_add artifacts"
        )

        def build(writer: ArtifactWriter) -> dict:
            started = time.time()
            project_dir = os.path.join(writer.local_dir, "project")
            prefix, db_dir = token_prefix(tokenize), local_dir(db, list(DB_FILES))
            database = ChunkDatabase(db_dir, [prefix])
            chunk_length = db.manifest()["chunk_length"]
            config = project_config(params, chunk_length, {})
            datasets = build_train_valid_test_datasets(
                DataConfig(
                    data_path=[prefix],
                    split=params.split,
                    data_cache_path=os.path.join(writer.local_dir, "cache"),
                ),
                params.seq_length,
                config.num_samples(),
                params.seed,
                params.gpt_tokenizer().eod,
            )
            counts = query_pretraining_neighbours(
                datasets,
                database,
                load_index(index.local_path(ADDED_INDEX), params.nprobe, params.ef_search),
                load_embedder(params.embedder_path(), params.batch_size, params.device),
                params.gpt_tokenizer(),
                chunk_length,
                params.config(),
                os.path.join(project_dir, layout.QUERY_DIR),
                held_out_samples(params, database),
            )
            config = dataclasses.replace(
                config,
                retro_neighbor_dirs={split: split if split in counts else None for split in SPLIT_NAMES},
            )
            self._link_inputs(params, prefix, db_dir, index, project_dir)
            config.save(project_dir)
            files = {
                os.path.relpath(os.path.join(root, name), project_dir): os.path.join(root, name)
                for root, _, names in os.walk(project_dir)
                for name in names
                if not is_temporary(name)
            }
            writer.commit_shard("project", files)
            summary = {f"{split}_chunks": n for split, n in counts.items()}
            log.info(
                "retro query: %s in %.1f s",
                ", ".join(f"{k} {v}" for k, v in summary.items()),
                time.time() - started,
            )
            return {"summary": summary}

        return self.build_artifact(params, inputs, store, build)

    @staticmethod
    def _link_inputs(
        params: QueryParams,
        prefix: str,
        db_dir: str,
        index: ArtifactRef,
        project_dir: str,
    ) -> None:
        """The project's data, tokenizer files, database, index and embedder, from the input artifacts."""
        data_prefix = os.path.join(project_dir, layout.DATA_DIR, DATA_NAME)
        link_or_copy(data_file_path(prefix), data_file_path(data_prefix))
        link_or_copy(index_file_path(prefix), index_file_path(data_prefix))
        for path in (params.gpt_vocab_file, params.gpt_merge_file, params.gpt_tokenizer_model):
            if path is not None:
                link_or_copy(path, os.path.join(project_dir, project_tokenizer_file(path)))
        link_or_copy(embedder_vocab(params.embedder_path())[0], os.path.join(project_dir, BERT_VOCAB))
        link_tree(params.embedder_path(), layout.embedder_dir(project_dir))
        project_db = layout.db_dir(project_dir)
        for name in DB_FILES:
            if name != DATASETS_FILE:
                link_or_copy(os.path.join(db_dir, name), os.path.join(project_db, name))
        with open(os.path.join(db_dir, DATASETS_FILE), encoding="utf-8") as f:
            infos = json.load(f)
        for info in infos:  # the project's own copy of the data, relative: the directory can move
            info["prefix"] = os.path.join("..", layout.DATA_DIR, DATA_NAME)
        atomic_write_text(os.path.join(project_db, DATASETS_FILE), json.dumps(infos, indent=2) + "\n")
        link_or_copy(index.local_path(ADDED_INDEX), layout.index_path(project_dir))


STAGE = RetroQueryStage()
run = STAGE.run
key = STAGE.key
