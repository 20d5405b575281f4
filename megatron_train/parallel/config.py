"""How the model is split across processes: Megatron's parallelism flags as one typed config."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelConfig:
    """Tensor, sequence, pipeline and data parallel layout (data parallel size = world / (TP * PP))."""

    tensor_model_parallel_size: int = field(
        default=1, metadata={"help": "Degree of tensor model parallelism (attention heads and MLP split)."}
    )
    pipeline_model_parallel_size: int = field(
        default=1, metadata={"help": "Degree of pipeline model parallelism (layers split into stages)."}
    )
    num_layers_per_virtual_pipeline_stage: int | None = field(
        default=None,
        metadata={"help": "Layers per virtual pipeline stage (interleaved schedule); None disables it."},
    )
    sequence_parallel: bool = field(
        default=False,
        metadata={"help": "Split norms, dropout and residuals along the sequence across the TP group."},
    )
    use_distributed_optimizer: bool = field(
        default=False, metadata={"help": "Shard optimizer state across data parallel ranks."}
    )
    pipeline_model_parallel_split_rank: int | None = field(
        default=None,
        metadata={"help": "Megatron's pipeline rank where T5's decoder starts; refused: T5 runs without PP."},
    )

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.pipeline_model_parallel_split_rank is not None:
            raise ValueError(
                f"--pipeline-model-parallel-split-rank {self.pipeline_model_parallel_split_rank}: splitting T5's "
                "encoder and decoder across pipeline stages is not implemented; drop the flag and train T5 with "
                "tensor, sequence and data parallelism (--pipeline-model-parallel-size 1)"
            )

    def data_parallel_size(self, world_size: int) -> int:
        """world_size / (TP * PP), with an actionable error when it does not divide."""
        model_parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                f"{self.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                f"{self.pipeline_model_parallel_size} = {model_parallel}; change the sizes or the process count"
            )
        return world_size // model_parallel

    def check_num_layers(self, num_layers: int) -> None:
        """Megatron's rule, checked here once for a run (arguments.validate_config): every pipeline stage, and
        every virtual stage when interleaved, holds the same number of layers."""
        pp, per_chunk = self.pipeline_model_parallel_size, self.num_layers_per_virtual_pipeline_stage
        if num_layers % pp:
            raise ValueError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}; every "
                "pipeline stage holds the same number of layers"
            )
        if per_chunk is not None and (num_layers // pp) % per_chunk:
            raise ValueError(
                f"--num-layers {num_layers} must split evenly into --pipeline-model-parallel-size {pp} stages "
                f"of --num-layers-per-virtual-pipeline-stage {per_chunk} layer chunks"
            )

    def virtual_pipeline_model_parallel_size(self, num_layers: int) -> int | None:
        """Model chunks per pipeline rank for the interleaved schedule (None when not interleaved); the layers
        split evenly (`check_num_layers`)."""
        if self.num_layers_per_virtual_pipeline_stage is None:
            return None
        return num_layers // self.pipeline_model_parallel_size // self.num_layers_per_virtual_pipeline_stage
