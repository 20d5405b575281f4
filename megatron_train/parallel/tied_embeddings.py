"""The word embedding tied to the output layer across pipeline stages (Megatron's embedding group).

Under pipeline parallelism the first stage holds the input embedding and the last stage a copy of it as the
output layer's weight. The model marks both copies `shared_embedding` (as Megatron-Core's
`shared_embedding_or_output_weight`); they start equal (`sync_embedding_weights`) and take the same step
because their grads are summed over the embedding group (`allreduce_embedding_grads`, called by
`distributed.finalize_model_grads`). See docs/architecture.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_train.parallel import state


def tied_embedding_weight(model: list[nn.Module]) -> nn.Parameter | None:
    """This rank's copy of the tied word embedding among its model chunks, or None where nothing is tied."""
    if state.get_pipeline_model_parallel_world_size() == 1:
        return None
    marked = [p for chunk in model for p in chunk.parameters() if getattr(p, "shared_embedding", False)]
    if len(marked) > 1:
        raise RuntimeError(
            f"pipeline stage {state.get_pipeline_model_parallel_rank()} holds {len(marked)} parameters marked "
            "shared_embedding; a stage holds at most one copy of the tied word embedding"
        )
    return marked[0] if marked else None


def sync_embedding_weights(model: list[nn.Module]) -> None:
    """Copy the first stage's word embedding into the last stage's output layer (tied weights start equal).

    Call once after building (or loading) the model, on every rank of the first and last stages.
    """
    weight = tied_embedding_weight(model)
    if weight is None:
        return
    first_stage_rank = state.get_pipeline_model_parallel_ranks()[0]
    with torch.no_grad():
        dist.broadcast(weight.data, src=first_stage_rank, group=state.get_embedding_group())


def allreduce_embedding_grads(model: list[nn.Module]) -> None:
    """Sum the tied word-embedding grads of the first and last pipeline stages (Megatron's
    `_allreduce_word_embedding_grads`), so both copies take the same optimizer step.

    Runs after the schedule and the data-parallel grad reduction, before the optimizer step; uses
    `param.main_grad` (the fp32 grad buffer) when the data-parallel wrapper set one.
    """
    weight = tied_embedding_weight(model)
    if weight is None:
        return
    grad = getattr(weight, "main_grad", None)
    if grad is None:
        grad = weight.grad
    if grad is None:
        raise RuntimeError(
            f"pipeline stage {state.get_pipeline_model_parallel_rank()}: the tied word embedding has no "
            "gradient; run the forward-backward schedule before allreduce_embedding_grads"
        )
    dist.all_reduce(grad, group=state.get_embedding_group())
