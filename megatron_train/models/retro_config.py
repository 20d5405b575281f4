"""Retro's model and data flags (Megatron's `--retro-*` names and defaults, megatron/core/models/retro/config.py).

`pretrain_retro` fills `retro_chunk_length` (and checks the other project settings) from the Retro project
directory's config.json, as Megatron's `load_retro_args` did; see docs/architecture.md (Retro model).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RetroConfig:
    """Retro settings: the project to train on, the neighbours each chunk attends to, the encoder."""

    retro_project_dir: str | None = field(
        default=None,
        metadata={
            "help": "Retro project directory (config.json, data, chunk database, neighbours) built by the "
            "Retro preprocessing flow; pretrain_retro takes data, tokenizer, sequence and chunk length from it."
        },
    )
    retro_add_retriever: bool = field(
        default=False,
        metadata={
            "help": "Train the Retro model (chunked cross-attention over retrieved neighbours); without it "
            "pretrain_retro trains a GPT on the same samples (Megatron's baseline)."
        },
    )
    retro_chunk_length: int | None = field(
        default=None,
        metadata={"help": "Tokens per Retro chunk; default the project's retro_gpt_chunk_length."},
    )
    retro_encoder_layers: int = field(
        default=2, metadata={"help": "Layers of the bidirectional encoder over the retrieved neighbours."}
    )
    retro_encoder_hidden_dropout: float = field(
        default=0.1, metadata={"help": "Hidden dropout of the Retro encoder."}
    )
    retro_encoder_attention_dropout: float = field(
        default=0.1, metadata={"help": "Attention dropout of the Retro encoder."}
    )
    retro_num_neighbors: int = field(
        default=2, metadata={"help": "Neighbours each chunk attends to (at most the project's saved count)."}
    )
    retro_num_retrieved_chunks: int = field(
        default=2,
        metadata={"help": "Database chunks per neighbour: the neighbour chunk and its continuation(s)."},
    )
    retro_verify_neighbor_count: bool = field(
        default=True,
        metadata={
            "help": "Check that the saved neighbours cover every chunk of every sample; "
            "--retro-no-verify-neighbor-count skips the check.",
            "flag": "--retro-no-verify-neighbor-count",
        },
    )
    retro_fit_freeze_decoder: bool = field(
        default=False,
        metadata={
            "help": "Retro-fitting: train only the chunked cross-attention and the encoder; the decoder "
            "(embedding, layers, output layer) keeps the GPT checkpoint's weights."
        },
    )

    @property
    def retro_retrieved_length(self) -> int:
        """Tokens per neighbour: num_retrieved_chunks x chunk_length (Megatron's retro_retrieved_length)."""
        if self.retro_chunk_length is None:
            raise ValueError(
                "--retro-chunk-length is not set (pretrain_retro takes it from --retro-project-dir)"
            )
        return self.retro_num_retrieved_chunks * self.retro_chunk_length

    def __post_init__(self) -> None:
        for name in ("retro_encoder_layers", "retro_num_neighbors", "retro_num_retrieved_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.retro_chunk_length is not None and self.retro_chunk_length < 1:
            raise ValueError(f"--retro-chunk-length must be >= 1, got {self.retro_chunk_length}")
