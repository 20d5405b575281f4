"""Retro's chunk database: every document of the GPT corpus cut into consecutive fixed-length chunks.

Each document (a `.idx` sequence, as in Megatron's GPT data) loses its trailing EOD token and is cut
every `retro_gpt_chunk_length` tokens, the last chunk shorter. Each chunk is detokenized with the GPT
tokenizer and re-tokenized with the embedder's (BERT WordPiece) tokenizer: a chunk with no embedder
tokens (e.g. only whitespace) is recorded as invalid, the others as valid. Rows are Megatron's
`chunks` columns `[dataset_idx, doc_id, start, end, bert_len]` (uint32).

Blocks of `retro_doc_block_size` documents are committed one file each (`retro.blocks`), so a killed
build redoes only the missing blocks; the merge then writes, in `db_dir`:

- `chunks.npy`: the valid chunks of the train split's documents (the split of --retro-gpt-split, the
  same documents pretraining trains on), in blend order: the rows the index holds, row = chunk id;
- `chunks_invalid.npy`: every invalid chunk;
- `datasets.json` (last, the commit marker): per dataset its prefix, blend weight and counts.

See docs/architecture.md (Retro preprocessing).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from megatron_train.data.config import parse_blend, parse_split, split_bounds, split_matrix
from megatron_train.tokenizer import MegatronTokenizer
from retro.blocks import block_path, check_settings, load_blocks, missing_blocks, save_block
from retro.config import ChunkDatabaseConfig
from storage.atomic import atomic_path, atomic_write_text
from storage.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)

CHUNK_COLUMNS = ("dataset_idx", "doc_id", "start", "end", "bert_len")
DATASETS_FILE = "datasets.json"


@dataclass(frozen=True)
class DatasetInfo:
    """One blended dataset of the database (Megatron's `indexed_dataset_infos.json` entry)."""

    prefix: str
    ratio: float
    n_docs: int
    n_docs_train: int
    n_chunks_train: int  # valid chunks of the train documents: this dataset's rows of chunks.npy
    n_chunks_invalid: int


def document_chunk_bounds(tokens: np.ndarray, eod: int, chunk_length: int) -> list[tuple[int, int]]:
    """[start, end) token ranges of one document's chunks, after dropping a trailing EOD."""
    length = len(tokens) - 1 if len(tokens) and int(tokens[-1]) == eod else len(tokens)
    return [(start, min(length, start + chunk_length)) for start in range(0, length, chunk_length)]


def build_block(
    dataset: IndexedDataset,
    dataset_idx: int,
    documents: range,
    gpt_tokenizer: MegatronTokenizer,
    bert_tokenizer: MegatronTokenizer,
    chunk_length: int,
) -> np.ndarray:
    """The chunk rows (valid and invalid) of `documents`, in document then position order."""
    rows: list[tuple[int, int, int, int]] = []
    texts: list[str] = []
    for doc_id in documents:
        tokens = dataset.get(doc_id)
        for start, end in document_chunk_bounds(tokens, gpt_tokenizer.eod, chunk_length):
            rows.append((dataset_idx, doc_id, start, end))
            texts.append(gpt_tokenizer.detokenize(tokens[start:end].tolist()))
    bert_lengths = [len(ids) for ids in bert_tokenizer.tokenize_batch(texts)] if texts else []
    block = np.zeros((len(rows), len(CHUNK_COLUMNS)), dtype=np.uint32)
    if rows:
        block[:, :4] = rows
        block[:, 4] = bert_lengths
    return block


def _blocks_dir(db_dir: str, dataset_idx: int) -> str:
    return os.path.join(db_dir, "blocks", f"{dataset_idx:03d}")


def build_chunk_database(
    data_path: Sequence[str],
    db_dir: str,
    config: ChunkDatabaseConfig,
    gpt_tokenizer: MegatronTokenizer,
    bert_tokenizer: MegatronTokenizer,
) -> ChunkDatabase:
    """Build (or finish building) the database of the `--retro-gpt-data-path` blend in `db_dir`.

    `data_path` is a blend as for `--data-path`: `prefix [prefix ...]` or `w1 prefix1 w2 prefix2 ...`.
    Returns the opened database; a finished one is opened at once.
    """
    blend = parse_blend(list(data_path), "--retro-gpt-data-path")
    prefixes = [os.path.abspath(prefix) for prefix in blend.prefixes]
    check_settings(
        db_dir,
        {
            "prefixes": prefixes,
            "weights": blend.weights,
            **asdict(config),
            "gpt_tokenizer": [type(gpt_tokenizer).__name__, gpt_tokenizer.vocab_size],
            "bert_tokenizer": [type(bert_tokenizer).__name__, bert_tokenizer.vocab_size],
        },
    )
    if os.path.isfile(os.path.join(db_dir, DATASETS_FILE)):
        return ChunkDatabase(db_dir)
    datasets = [IndexedDataset(prefix) for prefix in prefixes]
    for dataset_idx, dataset in enumerate(datasets):
        directory = _blocks_dir(db_dir, dataset_idx)
        missing = missing_blocks(directory, len(dataset), config.retro_doc_block_size)
        for number, (start, end) in enumerate(missing):
            block = build_block(
                dataset,
                dataset_idx,
                range(start, end),
                gpt_tokenizer,
                bert_tokenizer,
                config.retro_gpt_chunk_length,
            )
            save_block(block_path(directory, start, end), block)
            logger.info(
                "retro db: %s documents [%d, %d): %d chunks (block %d of the %d to build)",
                dataset.path_prefix,
                start,
                end,
                len(block),
                number + 1,
                len(missing),
            )
    _merge(db_dir, datasets, blend.weights, config)
    return ChunkDatabase(db_dir)


def _merge(
    db_dir: str, datasets: list[IndexedDataset], weights: list[float] | None, config: ChunkDatabaseConfig
) -> None:
    """Concatenate the blocks into chunks.npy / chunks_invalid.npy, then commit datasets.json."""
    train_bookend = split_matrix(parse_split(config.retro_gpt_split))[0]
    if train_bookend is None:
        raise ValueError(
            f"--retro-gpt-split {config.retro_gpt_split} has no train split: the database holds the train "
            "documents, give the train split a positive share"
        )
    valid_parts, invalid_parts, infos = [], [], []
    for dataset_idx, dataset in enumerate(datasets):
        rows = load_blocks(_blocks_dir(db_dir, dataset_idx), len(dataset), config.retro_doc_block_size)
        chunks = np.concatenate(rows) if rows else np.zeros((0, len(CHUNK_COLUMNS)), np.uint32)
        n_docs_train = split_bounds(train_bookend, len(dataset))[1]
        valid = chunks[:, 4] > 0
        train = valid & (chunks[:, 1] < n_docs_train)
        valid_parts.append(chunks[train])
        invalid_parts.append(chunks[~valid])
        infos.append(
            DatasetInfo(
                prefix=dataset.path_prefix,
                ratio=1.0 if weights is None else float(weights[dataset_idx]),
                n_docs=len(dataset),
                n_docs_train=n_docs_train,
                n_chunks_train=int(train.sum()),
                n_chunks_invalid=int((~valid).sum()),
            )
        )
    for name, parts in (("chunks.npy", valid_parts), ("chunks_invalid.npy", invalid_parts)):
        with atomic_path(os.path.join(db_dir, name)) as tmp, open(tmp, "wb") as f:
            np.save(f, np.concatenate(parts), allow_pickle=False)
    atomic_write_text(
        os.path.join(db_dir, DATASETS_FILE), json.dumps([asdict(info) for info in infos], indent=2) + "\n"
    )


class ChunkDatabase:
    """A finished chunk database: `chunks[i]` is chunk id i's row, its tokens read from the corpus."""

    def __init__(self, db_dir: str, prefixes: Sequence[str] | None = None) -> None:
        """`prefixes`: where the datasets are now, in blend order (a stage passes its input's local copy);
        by default the recorded prefixes, a relative one taken from `db_dir` (a Retro project's
        `../data/<name>`)."""
        path = os.path.join(db_dir, DATASETS_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no finished chunk database in {db_dir}; build it first")
        with open(path, encoding="utf-8") as f:
            self.infos = [DatasetInfo(**info) for info in json.load(f)]
        if prefixes is not None and len(prefixes) != len(self.infos):
            raise ValueError(
                f"{path}: the database holds {len(self.infos)} datasets, {len(prefixes)} prefixes given"
            )
        recorded = [os.path.normpath(os.path.join(db_dir, info.prefix)) for info in self.infos]
        self.prefixes = [os.path.abspath(p) for p in (recorded if prefixes is None else prefixes)]
        self.db_dir = db_dir
        self.chunks = np.load(os.path.join(db_dir, "chunks.npy"), mmap_mode="r")

    @functools.cached_property
    def datasets(self) -> list[IndexedDataset]:
        """The token data, opened on first use (the counts and rows need none)."""
        return [IndexedDataset(prefix) for prefix in self.prefixes]

    def __len__(self) -> int:
        return len(self.chunks)

    def dataset_idx(self, prefix: str) -> int:
        """The position of dataset `prefix` in the database's blend."""
        wanted = os.path.abspath(prefix)
        if wanted in self.prefixes:
            return self.prefixes.index(wanted)
        raise ValueError(
            f"{prefix}: not a dataset of the chunk database in {self.db_dir} "
            f"(it holds {self.prefixes}); query with the blend the database was built on"
        )

    def document_keys(self) -> np.ndarray:
        """One int64 per chunk naming its (dataset, document): `document_key(dataset_idx, doc_id)`."""
        return document_key(self.chunks[:, 0], self.chunks[:, 1])

    def with_chunks(self, rows: np.ndarray) -> ChunkDatabase:
        """This database with `rows` (CHUNK_COLUMNS) appended as chunk ids len(self), ...: an update held in
        memory (the Retro flow's database update adds held-out documents this way, docs/architecture.md)."""
        extended = copy.copy(self)
        extended.chunks = np.concatenate([np.asarray(self.chunks), rows.astype(self.chunks.dtype)])
        return extended

    def chunk_tokens(self, chunk_id: int) -> np.ndarray:
        dataset_idx, doc_id, start, end, _ = (int(v) for v in self.chunks[chunk_id])
        return self.datasets[dataset_idx].get(doc_id, offset=start, length=end - start)

    def chunk_texts(
        self, chunk_ids: Sequence[int] | np.ndarray, gpt_tokenizer: MegatronTokenizer
    ) -> list[str]:
        """The GPT-detokenized text of each chunk: what the embedder reads."""
        return [gpt_tokenizer.detokenize(self.chunk_tokens(int(i)).tolist()) for i in chunk_ids]


def document_key(dataset_idx: np.ndarray | int, doc_id: np.ndarray | int) -> np.ndarray:
    """(dataset, document) packed in one int64, for fast membership tests."""
    return (np.asarray(dataset_idx, dtype=np.int64) << 32) | np.asarray(doc_id, dtype=np.int64)
