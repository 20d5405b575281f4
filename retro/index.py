"""Retro's faiss index over the chunk database: train on a sample of chunks, then fill block by block.

The index comes from Megatron's `--retro-index-str` through `faiss.index_factory` (`IVF4096,Flat`,
`OPQ32_64,IVF65536_HNSW8,PQ32`, ...). Training embeds a seeded sample of the database's chunks
(`--retro-index-ntrain`, shared between datasets by blend weight, of which
`--retro-index-train-load-fraction` is loaded) and writes `trained.faissindex`; the IVF clustering runs
on GPU when faiss sees one. Filling follows Megatron's parallel-add index: each block of
`--retro-block-size` chunks is embedded and encoded (`sa_encode`) and its codes committed as one file,
so a killed fill resumes at the first missing block; the codes are then added with the chunk ids as
ids (`add_sa_codes`) and `added.faissindex` is written. Search-time `nprobe`/`efSearch` are set by
`set_search_parameters`. See docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict

import faiss
import numpy as np

from megatron_train.tokenizer import MegatronTokenizer
from retro.blocks import block_path, check_settings, load_blocks, missing_blocks, save_block
from retro.config import IndexConfig
from retro.db import ChunkDatabase
from storage.atomic import atomic_path

logger = logging.getLogger(__name__)

Embed = Callable[[list[str]], np.ndarray]  # texts -> float32 [len(texts), dim]

TRAINED_INDEX = "trained.faissindex"
ADDED_INDEX = "added.faissindex"


def embed_texts(embed: Embed, texts: list[str]) -> np.ndarray:
    """float32 [len(texts), dim] from `embed`, checked for shape (faiss needs contiguous float32)."""
    vectors = np.ascontiguousarray(embed(texts), dtype=np.float32)
    if vectors.ndim != 2 or len(vectors) != len(texts):
        raise ValueError(
            f"embed returned shape {vectors.shape} for {len(texts)} texts; it must return [n_texts, dim]"
        )
    return vectors


def embed_chunks(
    db: ChunkDatabase, chunk_ids: np.ndarray, embed: Embed, gpt_tokenizer: MegatronTokenizer
) -> np.ndarray:
    """The embeddings of database chunks' GPT-detokenized texts."""
    return embed_texts(embed, db.chunk_texts(chunk_ids, gpt_tokenizer))


def training_chunk_ids(db: ChunkDatabase, config: IndexConfig) -> np.ndarray:
    """Sorted chunk ids to train on: each dataset's share of `retro_index_ntrain` by blend weight,
    drawn without replacement with `retro_index_seed`, then the first `load_fraction` of that share."""
    total_ratio = sum(info.ratio for info in db.infos)
    rng = np.random.default_rng(config.retro_index_seed)
    ids, first_id = [], 0
    for info in db.infos:
        n_sampled = int(config.retro_index_ntrain * info.ratio / total_ratio)
        if n_sampled > info.n_chunks_train:
            raise ValueError(
                f"{info.prefix}: --retro-index-ntrain {config.retro_index_ntrain} asks {n_sampled} training "
                f"chunks of this dataset but its train documents have {info.n_chunks_train} valid chunks; "
                "lower --retro-index-ntrain"
            )
        sample = rng.choice(info.n_chunks_train, size=n_sampled, replace=False)
        n_loaded = int(config.retro_index_train_load_fraction * n_sampled)
        ids.append(first_id + sample[:n_loaded])
        first_id += info.n_chunks_train
    ids = np.sort(np.concatenate(ids)).astype(np.int64)
    if len(ids) == 0:
        raise ValueError(
            f"no training chunks: --retro-index-ntrain {config.retro_index_ntrain} with load fraction "
            f"{config.retro_index_train_load_fraction} samples none of the {len(db)} chunks of {db.db_dir}"
        )
    return ids


def _ivf(index: faiss.Index) -> faiss.IndexIVF | None:
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def set_search_parameters(index: faiss.Index, nprobe: int, ef_search: int) -> None:
    """`nprobe` IVF lists visited (at most all of them) and the HNSW quantizer's `efSearch`, where the
    index has them (`--retro-query-nprobe`, `--retro-query-ef-search`)."""
    ivf = _ivf(index)
    if ivf is None:
        return
    ivf.nprobe = min(nprobe, ivf.nlist)
    quantizer = faiss.downcast_index(ivf.quantizer)
    if isinstance(quantizer, faiss.IndexHNSW):
        quantizer.hnsw.efSearch = ef_search


def _check_index_settings(db: ChunkDatabase, config: IndexConfig, index_dir: str) -> None:
    check_settings(index_dir, {"db_dir": os.path.abspath(db.db_dir), **asdict(config)})


def write_index(index: faiss.Index, path: str) -> None:
    """Write a faiss index file atomically."""
    with atomic_path(path) as tmp:
        faiss.write_index(index, tmp)


def build_trained_index(vectors: np.ndarray, index_str: str) -> faiss.Index:
    """An empty `index_str` index trained on `vectors` (IVF clustering on the GPUs when faiss has them)."""
    try:
        index = faiss.index_factory(vectors.shape[1], index_str)
    except RuntimeError as err:
        raise ValueError(
            f"--retro-index-str {index_str!r} is not a faiss index_factory string for "
            f"{vectors.shape[1]}-dimensional vectors: {err}"
        ) from None
    ivf = _ivf(index)
    if ivf is not None and faiss.get_num_gpus() > 0:
        ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatL2(ivf.d))
    logger.info("retro index: training %s on %d chunks", index_str, len(vectors))
    index.train(vectors)
    return index


def require_block_encoding(index: faiss.Index, index_str: str) -> None:
    """Refuse an index that cannot `sa_encode` (it could not be filled block by block)."""
    try:
        index.sa_code_size()
    except RuntimeError:
        raise ValueError(
            f"--retro-index-str {index_str!r}: this faiss index cannot encode vectors apart from "
            "adding them (no sa_encode), so it cannot be filled block by block; use an IVF index "
            "(e.g. IVF4096,Flat or OPQ32_64,IVF65536_HNSW8,PQ32) or Flat"
        ) from None


def train_index(
    db: ChunkDatabase, config: IndexConfig, embed: Embed, gpt_tokenizer: MegatronTokenizer, index_dir: str
) -> str:
    """Train an empty index of `retro_index_str` on sampled chunks; returns `<index_dir>/trained.faissindex`
    (at once if it exists)."""
    path = os.path.join(index_dir, TRAINED_INDEX)
    _check_index_settings(db, config, index_dir)
    if os.path.isfile(path):
        return path
    ids = training_chunk_ids(db, config)
    vectors = np.concatenate(
        [
            embed_chunks(db, ids[start : start + config.retro_block_size], embed, gpt_tokenizer)
            for start in range(0, len(ids), config.retro_block_size)
        ]
    )
    index = build_trained_index(vectors, config.retro_index_str)
    write_index(index, path)
    return path


def add_to_index(
    db: ChunkDatabase, config: IndexConfig, embed: Embed, gpt_tokenizer: MegatronTokenizer, index_dir: str
) -> str:
    """Fill the trained index with every database chunk (id = chunk id); returns
    `<index_dir>/added.faissindex` (at once if it exists). Committed code blocks are never recomputed."""
    path = os.path.join(index_dir, ADDED_INDEX)
    _check_index_settings(db, config, index_dir)
    if os.path.isfile(path):
        return path
    trained_path = os.path.join(index_dir, TRAINED_INDEX)
    if not os.path.isfile(trained_path):
        raise FileNotFoundError(f"{trained_path}: the index is not trained yet; run train_index first")
    index = faiss.read_index(trained_path)
    require_block_encoding(index, config.retro_index_str)
    codes_dir = os.path.join(index_dir, "codes")
    missing = missing_blocks(codes_dir, len(db), config.retro_block_size)
    for number, (start, end) in enumerate(missing):
        vectors = embed_chunks(db, np.arange(start, end), embed, gpt_tokenizer)
        save_block(block_path(codes_dir, start, end), index.sa_encode(vectors))
        logger.info(
            "retro index: encoded chunks [%d, %d) (block %d/%d)", start, end, number + 1, len(missing)
        )
    add_codes(index, load_blocks(codes_dir, len(db), config.retro_block_size))
    write_index(index, path)
    return path


def add_codes(index: faiss.Index, code_blocks: Iterable[np.ndarray]) -> None:
    """Add `sa_encode` codes, block after block, with consecutive ids from 0 (the chunk ids)."""
    ivf = _ivf(index)
    target = index if ivf is None else ivf
    for codes in code_blocks:
        target.add_sa_codes(codes, np.arange(target.ntotal, target.ntotal + len(codes), dtype=np.int64))
    index.ntotal = target.ntotal


def load_index(path: str, nprobe: int, ef_search: int) -> faiss.Index:
    """Read a filled index and set its search-time parameters."""
    index = faiss.read_index(path)
    set_search_parameters(index, nprobe, ef_search)
    return index
