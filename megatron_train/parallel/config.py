"""How the model is split across processes: Megatron's parallelism flags as one typed config."""

from __future__ import annotations

from dataclasses import dataclass, field


def pipeline_stage_layer_counts(
    num_layers: int, pipeline_size: int, first: int | None = None, last: int | None = None
) -> list[int]:
    """Layers of each pipeline stage: equal shares, or Megatron-Core's uneven split where
    --num-layers-in-first-pipeline-stage / --num-layers-in-last-pipeline-stage (`first`, `last`) fix the ends and
    the stages between share the rest equally. Raises ValueError naming the flag when the layers do not split."""
    fixed = {0: first, pipeline_size - 1: last} if pipeline_size > 1 else {}
    fixed = {stage: count for stage, count in fixed.items() if count is not None}
    for stage, count in fixed.items():
        if count < 0:
            flag = "first" if stage == 0 else "last"
            raise ValueError(f"--num-layers-in-{flag}-pipeline-stage must be >= 0, got {count}")
    rest, stages = num_layers - sum(fixed.values()), pipeline_size - len(fixed)
    if rest < 0 or (stages and rest % stages) or (not stages and rest):
        ends = " and ".join(
            f"--num-layers-in-{'first' if stage == 0 else 'last'}-pipeline-stage {count}"
            for stage, count in fixed.items()
        )
        given = f" minus {ends}" if fixed else ""
        raise ValueError(
            f"--num-layers {num_layers}{given} does not split evenly over the {stages} other pipeline stages of "
            f"--pipeline-model-parallel-size {pipeline_size}"
            if fixed
            else f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pipeline_size}"
        )
    share = rest // stages if stages else 0
    return [fixed.get(stage, share) for stage in range(pipeline_size)]


@dataclass
class ParallelConfig:
    """Tensor, sequence, context, pipeline and data parallel layout (data parallel size = world / (TP x CP x
    PP))."""

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
    context_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Degree of context parallelism: each sequence split over this many ranks (ring attention)."
        },
    )
    overlap_p2p_comm: bool = field(
        default=True,
        metadata={
            "help": "1F1B: post the pipeline's sends and receives without waiting, overlapping them with the next "
            "forward or backward; --no-overlap-p2p-communication waits for each exchange.",
            "flag": "--no-overlap-p2p-communication",
            "opposite_flag": "--overlap-p2p-communication",
        },
    )
    expert_model_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Degree of expert parallelism: the MoE layers' experts split over this many ranks."
        },
    )
    expert_tensor_parallel_size: int | None = field(
        default=None,
        metadata={
            "help": "Degree of tensor parallelism inside each expert; default --tensor-model-parallel-size."
        },
    )
    use_distributed_optimizer: bool = field(
        default=False, metadata={"help": "Shard optimizer state across data parallel ranks."}
    )
    pipeline_model_parallel_split_rank: int | None = field(
        default=None,
        metadata={"help": "Megatron's pipeline rank where T5's decoder starts; refused: T5 runs without PP."},
    )

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
        ):
            if (getattr(self, name) or 1) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.pipeline_model_parallel_split_rank is not None:
            raise ValueError(
                f"--pipeline-model-parallel-split-rank {self.pipeline_model_parallel_split_rank}: splitting T5's "
                "encoder and decoder across pipeline stages is not implemented; drop the flag and train T5 with "
                "tensor, sequence and data parallelism (--pipeline-model-parallel-size 1)"
            )

    def data_parallel_size(self, world_size: int) -> int:
        """world_size / (TP x CP x PP), with an actionable error when it does not divide."""
        cp = self.context_parallel_size
        model_parallel = self.tensor_model_parallel_size * cp * self.pipeline_model_parallel_size
        if world_size % model_parallel:
            context = f" x --context-parallel-size {cp}" if cp > 1 else ""
            raise ValueError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                f"{self.tensor_model_parallel_size}{context} x --pipeline-model-parallel-size "
                f"{self.pipeline_model_parallel_size} = {model_parallel}; change the sizes or the process count"
            )
        return world_size // model_parallel

    @property
    def expert_tensor_size(self) -> int:
        """--expert-tensor-parallel-size, which defaults to the tensor parallel size (as Megatron)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def expert_data_parallel_size(self, world_size: int) -> int:
        """world_size / (ETP * EP * PP): how many replicas of each expert train (Megatron's expert rank layout)."""
        experts = self.expert_tensor_size * self.expert_model_parallel_size
        model_parallel = experts * self.pipeline_model_parallel_size
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by --expert-tensor-parallel-size "
                f"{self.expert_tensor_size} x --expert-model-parallel-size {self.expert_model_parallel_size}"
                f" x --pipeline-model-parallel-size {self.pipeline_model_parallel_size} = {model_parallel}; change "
                "the sizes or the process count"
            )
        return world_size // model_parallel

    def check_num_layers(self, num_layers: int, first: int | None = None, last: int | None = None) -> None:
        """Megatron's rule, checked here once for a run (arguments.validate_config): every pipeline stage, and
        every virtual stage when interleaved, holds the same number of layers, but the first and last stages where
        --num-layers-in-first/last-pipeline-stage (`first`, `last`) set theirs (not interleaved)."""
        pp, per_chunk = self.pipeline_model_parallel_size, self.num_layers_per_virtual_pipeline_stage
        uneven = first is not None or last is not None
        if uneven and pp == 1:
            raise ValueError(
                "--num-layers-in-first/last-pipeline-stage split layers between pipeline stages: they need "
                "--pipeline-model-parallel-size > 1"
            )
        if uneven and per_chunk is not None:
            raise ValueError(
                "--num-layers-in-first/last-pipeline-stage with --num-layers-per-virtual-pipeline-stage is not "
                "implemented: drop one of them"
            )
        pipeline_stage_layer_counts(num_layers, pp, first, last)
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
