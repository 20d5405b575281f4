"""The one step between the backward passes and the optimizer (Megatron-Core's `finalize_model_grads`)."""

from __future__ import annotations

from torch import nn

from megatron_train.models.moe.router import TopKRouter
from megatron_train.parallel.layers import allreduce_sequence_parallel_grads
from megatron_train.parallel.tied_embeddings import allreduce_embedding_grads


def finalize_model_grads(model: list[nn.Module]) -> None:
    """Finish every chunk's data-parallel grad reduction, sum the sequence-parallel norm and bias grads over
    the TP group, then the tied word-embedding grads over the first and last pipeline stages; MoE routers update
    their expert bias from the step's token counts (Megatron's _update_router_expert_bias).

    `model` is this rank's model chunks in their data-parallel wrappers (see docs/architecture.md).
    """
    for chunk in model:
        chunk.finish_grad_sync()
    for chunk in model:
        allreduce_sequence_parallel_grads(chunk)
    allreduce_embedding_grads(model)
    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, TopKRouter) and module.training:
                module.end_of_step()
