"""Retro preprocessing settings, one typed config per step, fields named after Megatron's `--retro-*` flags.

Defaults are Megatron's (`RetroPreprocessingConfig` in megatron/core/datasets/retro/config); see
docs/architecture.md for how the chunk database, the index and the neighbour query fit together.
"""

from __future__ import annotations

from dataclasses import dataclass


def require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


@dataclass(frozen=True)
class ChunkDatabaseConfig:
    """How documents are cut into chunks and how many documents one committed block holds."""

    retro_gpt_chunk_length: int = 64
    retro_doc_block_size: int = 100_000
    retro_gpt_split: str = "969,30,1"  # the pretraining --split: the database holds the train documents

    def __post_init__(self) -> None:
        require_positive(
            retro_gpt_chunk_length=self.retro_gpt_chunk_length, retro_doc_block_size=self.retro_doc_block_size
        )


@dataclass(frozen=True)
class IndexConfig:
    """The faiss index (`faiss.index_factory` string), what it is trained on and how it is filled."""

    retro_index_str: str = "IVF4096,Flat"
    retro_index_ntrain: int = 100_000  # database chunks sampled to train the index
    retro_index_train_load_fraction: float = 1.0  # fraction of the sampled chunks actually loaded
    retro_block_size: int = 100_000  # chunks embedded and encoded per committed block
    retro_index_seed: int = 1234  # seed of the training sample

    def __post_init__(self) -> None:
        require_positive(retro_index_ntrain=self.retro_index_ntrain, retro_block_size=self.retro_block_size)
        if not 0.0 < self.retro_index_train_load_fraction <= 1.0:
            raise ValueError(
                "--retro-index-train-load-fraction must be in (0, 1], got "
                f"{self.retro_index_train_load_fraction}"
            )


@dataclass(frozen=True)
class QueryConfig:
    """How many neighbours are searched and kept per chunk, and the index's search-time parameters."""

    retro_query_nprobe: int = 65536  # IVF lists visited (capped by faiss at the number of lists)
    retro_query_ef_search: int = 256  # HNSW search breadth (used by indexes with an HNSW part)
    retro_query_num_neighbors_query: int = 200
    retro_query_num_neighbors_save: int = 20
    retro_block_size: int = 100_000  # query chunks per committed block

    def __post_init__(self) -> None:
        require_positive(
            retro_query_nprobe=self.retro_query_nprobe,
            retro_query_ef_search=self.retro_query_ef_search,
            retro_query_num_neighbors_query=self.retro_query_num_neighbors_query,
            retro_query_num_neighbors_save=self.retro_query_num_neighbors_save,
            retro_block_size=self.retro_block_size,
        )
        if self.retro_query_num_neighbors_save > self.retro_query_num_neighbors_query:
            raise ValueError(
                f"--retro-query-num-neighbors-save ({self.retro_query_num_neighbors_save}) exceeds "
                f"--retro-query-num-neighbors-query ({self.retro_query_num_neighbors_query}): query at least "
                "as many neighbours as are saved"
            )
