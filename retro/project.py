"""The Retro project directory: what preprocessing hands to `pretrain_retro --retro-project-dir DIR`.

Megatron's layout (tools/retro/preprocess_data.py `save_config`, megatron/training/arguments.py
`load_retro_args`), with our block formats:

    DIR/config.json             the fields of `RetroProject` (Megatron's `retro_gpt_*` / `retro_bert_*` names)
    DIR/data/<prefix>.bin/.idx  the GPT token data; `retro_gpt_data_path` names prefixes relative to DIR/data
    DIR/gpt/, DIR/bert/         GPT tokenizer files and the BERT vocab.txt, named in config.json relative to DIR
    DIR/db/                     the chunk database (`retro.db.ChunkDatabase(db_dir(DIR))`: chunks.npy,
                                datasets.json naming ../data/<prefix>); neighbour ids are its row numbers
    DIR/index/added.faissindex  the filled faiss index (for retrieval at generation time)
    DIR/query/<split>/          int64 [chunks, retro_query_num_neighbors_save] blocks of each split, -1 padded
                                (`retro.query.load_neighbours`; row = sample * chunks per sample + chunk);
                                `retro_neighbor_dirs` maps train/valid/test to these, relative to DIR/query
    DIR/embedder/               the embedder (`retro.embedder.load_embedder(embedder_dir(DIR))`)

Pretraining takes sequence length, data blend, split, seed, sample counts and tokenizer from config.json, as
Megatron did, so the samples it trains on are the samples the neighbours were queried for. See
docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from storage.atomic import atomic_write_text

CONFIG_FILE = "config.json"
DATA_DIR = "data"
DB_DIR = "db"
INDEX_DIR = "index"
QUERY_DIR = "query"
EMBEDDER_DIR = "embedder"
SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class RetroProject:
    """config.json of a Retro project directory; paths are relative to the directory (see the module doc)."""

    retro_gpt_data_path: list[
        str
    ]  # a --data-path blend of prefixes under DIR/data: ["corpus"] or ["1", "a", ...]
    retro_gpt_split: str
    retro_gpt_seq_length: int
    retro_gpt_chunk_length: int
    retro_gpt_seed: int
    retro_gpt_train_samples: int
    retro_gpt_eval_interval: int
    retro_gpt_eval_iters: int
    retro_gpt_global_batch_size: int
    retro_gpt_tokenizer_type: str
    retro_bert_tokenizer_type: str
    retro_bert_vocab_file: str  # relative to DIR
    retro_block_size: int
    retro_query_num_neighbors_save: int  # columns of every neighbour block
    retro_neighbor_dirs: dict[str, str | None] = field(default_factory=dict)  # split -> dir under DIR/query
    retro_gpt_vocab_file: str | None = None  # relative to DIR
    retro_gpt_merge_file: str | None = None  # relative to DIR
    retro_gpt_tokenizer_model: str | None = None  # relative to DIR
    retro_gpt_data_cache_path: str | None = None

    def num_samples(self) -> tuple[int, int, int]:
        """(train, valid, test) sample counts as Megatron's training derives them from these fields:
        train_samples, then eval_iters global batches at every eval_interval and once at the end."""
        train_iters = self.retro_gpt_train_samples // self.retro_gpt_global_batch_size
        evaluations = train_iters // self.retro_gpt_eval_interval + 1
        eval_samples = self.retro_gpt_eval_iters * self.retro_gpt_global_batch_size
        return self.retro_gpt_train_samples, evaluations * eval_samples, eval_samples

    def data_path(self, project_dir: str) -> list[str]:
        """`retro_gpt_data_path` with its prefixes made paths under DIR/data (weights kept)."""
        blend = list(self.retro_gpt_data_path)
        prefix_positions = range(len(blend)) if len(blend) == 1 else range(1, len(blend), 2)
        for i in prefix_positions:
            blend[i] = os.path.join(project_dir, DATA_DIR, blend[i])
        return blend

    def path(self, project_dir: str, relative: str | None) -> str | None:
        """A file named in the config (vocabulary, merges, tokenizer model) as a path."""
        return None if relative is None else os.path.join(project_dir, relative)

    def neighbor_dir(self, project_dir: str, split: str) -> str | None:
        """The neighbour blocks of `split` (train, valid or test), or None when that split has no samples."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
        relative = self.retro_neighbor_dirs.get(split)
        return None if relative is None else os.path.join(project_dir, QUERY_DIR, relative)

    def save(self, project_dir: str) -> str:
        """Write DIR/config.json atomically; returns its path."""
        path = os.path.join(project_dir, CONFIG_FILE)
        os.makedirs(project_dir, exist_ok=True)
        atomic_write_text(path, json.dumps(dataclasses.asdict(self), indent=4, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, project_dir: str) -> RetroProject:
        """Read DIR/config.json; an error names the file and the missing or unknown fields."""
        path = os.path.join(project_dir, CONFIG_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path}: no Retro project config; --retro-project-dir must be a directory built by "
                "flows/retro_flow.py (make retro)"
            )
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        required = {
            name
            for name, f in fields.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = sorted(required - set(values))
        if unknown or missing:
            raise ValueError(
                f"{path}: not a Retro project config of this version (missing {missing or 'none'}, unknown "
                f"{unknown or 'none'}); rebuild the project with flows/retro_flow.py"
            )
        return cls(**values)


def db_dir(project_dir: str) -> str:
    return os.path.join(project_dir, DB_DIR)


def index_path(project_dir: str) -> str:
    return os.path.join(project_dir, INDEX_DIR, "added.faissindex")


def embedder_dir(project_dir: str) -> str:
    return os.path.join(project_dir, EMBEDDER_DIR)
