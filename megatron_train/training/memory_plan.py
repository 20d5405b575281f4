"""What a parallel layout costs each rank, before a GPU is rented (`tools/report_theoretical_memory`).

Exact figures: `stage_memory` builds one rank of each pipeline stage the way training does (the family's model
provider, our DDP and optimizer) on the meta device, in a fake process group of the planned world size
(torch's "fake" backend: every collective is a no-op), and counts what its tensors hold: every parameter
(biases, norms, position embeddings, the tied output layer's copy on the last stage, the vocabulary padded for
TP), the gradient buffers (fp32 with --bf16, padded per bucket for the distributed optimizer), the fp32 main
params and the optimizer's moments (this rank's part of them under the distributed optimizer).

Estimates (stated as such): activations per stage (Korthikanti et al. 2022 with flash attention: 34 s b h / TP
bytes a layer under sequence parallelism, s b h (10 + 24 / TP) without; the layer inputs alone under full
recompute; s divided by CP; times the micro-batches a 1F1B stage keeps in flight), FLOPs per step from the
family's terms, the bytes each rank sends per step (the closed forms `benchmarks/communication.py` and
`tests/test_context_parallel.py` check), and a step time from a peak TFLOP/s and link bandwidths with the pipeline
bubble, communication not overlapped.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_train.arguments import MegatronConfig
from megatron_train.families.family import ModelFamily
from megatron_train.models.context_attention import ring_bytes_per_rank
from megatron_train.parallel import state
from megatron_train.training.setup import wrap_and_optimize


@contextlib.contextmanager
def planned_rank(config: MegatronConfig, world_size: int, rank: int) -> Iterator[None]:
    """Rank `rank` of a fake `world_size`-rank job with the run's process groups."""
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,
    )  # torch's fake backend registers on import

    if dist.is_initialized():
        raise RuntimeError(
            "the planner builds ranks in a fake process group: run it outside a distributed job"
        )
    parallel = config.parallel
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        state.initialize_model_parallel(
            parallel.tensor_model_parallel_size,
            parallel.pipeline_model_parallel_size,
            parallel.virtual_pipeline_model_parallel_size(config.model.num_layers),
            parallel.context_parallel_size,
            parallel.expert_model_parallel_size,
            parallel.expert_tensor_size,
        )
        yield
    finally:
        state.destroy_model_parallel()
        dist.destroy_process_group()


@dataclass(frozen=True)
class StageMemory:
    """One rank of pipeline stage `pp_rank` (TP rank 0, data-parallel rank `dp_rank`): its layers and the bytes
    of its parameters, gradient buffers and optimizer state (fp32 main params and moments)."""

    pp_rank: int
    layers: list[int]
    parameters: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def model_state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def _moments(config: MegatronConfig) -> int:
    """fp32 state tensors the optimizer keeps per parameter: Adam's two moments, SGD's momentum buffer."""
    optimizer = config.optimizer
    if optimizer.optimizer == "adam":
        return 2
    return 1 if optimizer.sgd_momentum else 0


def model_state_bytes(
    model: list[torch.nn.Module], optimizer, config: MegatronConfig
) -> tuple[int, int, int]:
    """(parameters, gradient buffers, optimizer state) bytes of a built rank: the DDP's buffers as allocated
    (the distributed optimizer's param buffer padded like its grads), the main params that are copies, and the
    moments the optimizer creates at its first step, one per element of each main param."""
    params = grads = 0
    for chunk in model:
        grads += sum(buffer.numel() * buffer.element_size() for buffer in chunk.buffers)
        buffered = {id(p) for bucket in chunk.buckets for p in bucket.params}
        if any(bucket.param_data is not None for bucket in chunk.buckets):
            params += sum(b.param_data.numel() * b.param_data.element_size() for b in chunk.buckets)
        else:
            params += sum(p.numel() * p.element_size() for p in chunk.parameters() if id(p) in buffered)
        params += sum(p.numel() * p.element_size() for p in chunk.parameters() if id(p) not in buffered)
    mains = [m for m in optimizer.main_params if m is not None]
    copies = sum(m.numel() * 4 for m, p in zip(optimizer.main_params, optimizer.model_params, strict=True)
                 if m is not None and m is not p)  # fmt: skip
    return params, grads, copies + _moments(config) * 4 * sum(m.numel() for m in mains)


def stage_memory(
    config: MegatronConfig, family: ModelFamily, padded_vocab_size: int, world_size: int, pp_rank: int,
    dp_rank: int = 0,
) -> StageMemory:  # fmt: skip
    """The exact memory of data-parallel rank `dp_rank` of pipeline stage `pp_rank` (see the module docstring)."""
    parallel = config.parallel
    tp, cp, pp = (
        parallel.tensor_model_parallel_size,
        parallel.context_parallel_size,
        parallel.pipeline_model_parallel_size,
    )
    dp = parallel.data_parallel_size(world_size)
    config = copy.deepcopy(config)
    config.training.use_cpu_initialization = (
        False  # no CPU master weights: everything stays on the meta device
    )
    with planned_rank(config, world_size, (pp_rank * dp + dp_rank) * tp * cp):
        chunks = []
        for vp_stage in range(state.get_virtual_pipeline_model_parallel_world_size() or 1):
            with torch.device("meta"):
                chunks.append(
                    family.model_provider(
                        config, padded_vocab_size, state.is_pipeline_first_stage(vp_stage),
                        state.is_pipeline_last_stage(vp_stage), vp_stage,
                    )
                )  # fmt: skip
        model, optimizer = wrap_and_optimize(config, chunks)
        params, grads, optimizer_bytes = model_state_bytes(model, optimizer, config)
        layers = family.pipeline.stage_layers(
            config.model, pp_rank, pp, state.get_virtual_pipeline_model_parallel_world_size()
        )
        parameters = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    return StageMemory(pp_rank, layers, parameters, params, grads, optimizer_bytes)


def activation_bytes(config: MegatronConfig, stage: StageMemory, num_microbatches: int) -> float:
    """Estimated activation bytes stage `stage` keeps (see the module docstring): per layer and micro-batch,
    times its layers, times the micro-batches in flight (1F1B: PP - stage, at most the micro-batches)."""
    model, parallel = config.model, config.parallel
    tp, cp, pp = (
        parallel.tensor_model_parallel_size,
        parallel.context_parallel_size,
        parallel.pipeline_model_parallel_size,
    )
    sbh = model.seq_length // cp * config.training.micro_batch_size * model.hidden_size
    per_layer = 34 * sbh / tp if parallel.sequence_parallel else sbh * (10 + 24 / tp)
    layers = len(stage.layers)
    if model.recompute_granularity == "full":  # each layer's input kept; one layer recomputed at a time
        per_layer_input = 2 * sbh / (tp if parallel.sequence_parallel else 1)
        per_microbatch = per_layer_input * layers + per_layer
    else:
        per_microbatch = per_layer * layers
    in_flight = min(pp - stage.pp_rank, num_microbatches)
    return per_microbatch * in_flight


def communication_bytes(
    config: MegatronConfig, stage: StageMemory, num_microbatches: int, world_size: int
) -> dict[str, float]:
    """Bytes one rank of stage `stage` sends per step, by kind (ring algorithms: all-reduce 2(t-1)/t N,
    all-gather and reduce-scatter (t-1)/t N; point-to-point its tensors), activations in the params dtype."""
    model, parallel, training = config.model, config.parallel, config.training
    tp, cp, pp = (
        parallel.tensor_model_parallel_size,
        parallel.context_parallel_size,
        parallel.pipeline_model_parallel_size,
    )
    element = torch.tensor([], dtype=model.params_dtype).element_size()
    seq, b = model.seq_length // cp, training.micro_batch_size
    sbh = seq * b * model.hidden_size * element
    first, last = stage.pp_rank == 0, stage.pp_rank == pp - 1
    sent: dict[str, float] = {}
    if (
        tp > 1
    ):  # 4 per layer (2 forward, 2 backward), the embedding's and the output layer's, cross entropy's 3
        collectives = 4 * len(stage.layers) + int(first) + int(last)
        sent["tensor parallel"] = 2 * (tp - 1) / tp * (collectives * sbh + (3 * seq * b * 4 if last else 0))
    if cp > 1:
        groups = model.num_query_groups_effective // tp
        if model.cp_comm_type == "p2p":
            per_layer = sum(ring_bytes_per_rank(b, model.seq_length, cp, groups, model.kv_channels, element))
        else:  # all_gather: keys and values gathered, their grads reduce-scattered; a2a: 4 all-to-alls each way
            kv = 2 * b * model.seq_length * groups * model.kv_channels * element
            qkv_out = b * model.seq_length * (2 * model.num_attention_heads + 2 * groups) * model.kv_channels
            per_layer = (
                (cp - 1) / cp * (2 * kv if model.cp_comm_type == "all_gather" else 2 * qkv_out * element / cp)
            )
        sent["context parallel"] = per_layer * len(stage.layers)
    if pp > 1:
        message = sbh / (tp if parallel.sequence_parallel else 1)
        sent["pipeline p2p"] = message * ((not last) + (not first))
    for kind in sent:
        sent[kind] *= num_microbatches
    replicas = parallel.data_parallel_size(world_size) * cp
    if replicas > 1:  # all-reduce of the grads; reduce-scatter + all-gather with the distributed optimizer
        sent["data parallel"] = 2 * (replicas - 1) / replicas * stage.grads_bytes
    return sent


def bubble_fraction(pipeline_size: int, num_microbatches: int, virtual_size: int | None) -> float:
    """The 1F1B bubble over the ideal step time: (p - 1) / (v m)."""
    return (pipeline_size - 1) / ((virtual_size or 1) * num_microbatches)


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    communication: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.communication


def step_time(
    config: MegatronConfig,
    flops_per_step: float,
    world_size: int,
    num_microbatches: int,
    sent: dict[str, float],
    peak_tflops: float,
    intra_node_gbs: float,
    inter_node_gbs: float,
    gpus_per_node: int,
) -> StepTime:
    """Estimated seconds per step: the FLOPs of one rank at peak, the 1F1B bubble, and the slowest stage's bytes
    over its links (tensor and context parallel inside a node when they fit, the rest across nodes), without
    overlap."""
    parallel = config.parallel
    compute = flops_per_step / world_size / (peak_tflops * 1e12)
    virtual = parallel.virtual_pipeline_model_parallel_size(config.model.num_layers)
    bubble = compute * bubble_fraction(parallel.pipeline_model_parallel_size, num_microbatches, virtual)
    inside = parallel.tensor_model_parallel_size * parallel.context_parallel_size <= gpus_per_node
    across = world_size > gpus_per_node
    seconds = 0.0
    for kind, nbytes in sent.items():
        local = kind in ("tensor parallel", "context parallel") and inside or not across
        seconds += nbytes / ((intra_node_gbs if local else inter_node_gbs) * 1e9)
    return StepTime(compute, bubble, seconds)


def stages_to_plan(config: MegatronConfig) -> list[int]:
    """Every pipeline stage (up to 8 of them: the first three, the last three and two between)."""
    pp = config.parallel.pipeline_model_parallel_size
    if pp <= 8:
        return list(range(pp))
    return sorted({0, 1, 2, pp // 2 - 1, pp // 2, pp - 3, pp - 2, pp - 1})


def megabytes(nbytes: float) -> float:
    return nbytes / 2**20
