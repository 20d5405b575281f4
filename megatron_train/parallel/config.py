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

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

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

    def virtual_pipeline_model_parallel_size(self, num_layers: int) -> int | None:
        """Model chunks per pipeline rank for the interleaved schedule (None when not interleaved)."""
        if self.num_layers_per_virtual_pipeline_stage is None:
            return None
        layers_per_stage, remainder = divmod(num_layers, self.pipeline_model_parallel_size)
        if remainder or layers_per_stage % self.num_layers_per_virtual_pipeline_stage:
            raise ValueError(
                f"--num-layers {num_layers} must split evenly into --pipeline-model-parallel-size "
                f"{self.pipeline_model_parallel_size} stages of --num-layers-per-virtual-pipeline-stage "
                f"{self.num_layers_per_virtual_pipeline_stage} layer chunks"
            )
        return layers_per_stage // self.num_layers_per_virtual_pipeline_stage
