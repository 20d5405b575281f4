"""`--calculate-per-token-loss`: the step's loss is the sum of all token losses over the number of unmasked
tokens in the whole global batch (every micro-batch, every DP rank), not the mean of per-micro-batch means.

Megatron-Core sums losses in the schedule and divides the grads by the global token count in
`finalize_model_grads`. Here the loss function returns each micro-batch's loss *sum* (with its token count under
`NUM_TOKENS_KEY`), the schedule still divides by the number of micro-batches M and the data-parallel wrapper
still averages over the DP size D, so `scale_grads_to_per_token_loss` multiplies the reduced grads by
M * D / total tokens: the same gradient of the same loss (see docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_train.device import get_device
from megatron_train.parallel import state

NUM_TOKENS_KEY = "num tokens"  # entry of loss_func's reduced dict: unmasked tokens of the micro-batch


def language_model_loss(
    loss_mask: torch.Tensor,
    output_tensor: torch.Tensor,
    per_token_loss: bool = False,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every family's `lm loss` (Megatron's GPT loss_func): the mean of the per-token losses `output_tensor` over
    the micro-batch's unmasked tokens; with `per_token_loss` (--calculate-per-token-loss) their sum and count,
    for the loop to divide.

    Under context parallelism (`cp_group`) each rank holds part of the sequence's tokens: the sum and count are
    summed over the group (the logged values are the whole sequence's), and the loss to differentiate is this
    rank's sum over the whole count, times CP, because the gradients are averaged over data x context parallel
    (Megatron's loss_func multiplies by the context-parallel size the same way)."""
    loss_mask = loss_mask.float()
    loss_sum = (output_tensor.float() * loss_mask).sum()
    count = loss_mask.sum()
    cp_size = state.group_size(cp_group)
    total_sum, total_count = loss_sum.detach(), count
    if cp_size > 1:
        totals = torch.stack([total_sum, total_count])
        dist.all_reduce(totals, group=cp_group)
        total_sum, total_count = totals[0], totals[1]
    if per_token_loss:
        return loss_sum * cp_size, {"lm loss": total_sum, NUM_TOKENS_KEY: total_count}
    loss = loss_sum * cp_size / total_count.clamp(min=1.0)
    return loss, {"lm loss": total_sum / total_count.clamp(min=1.0)}


def global_num_tokens(reduced: list[dict[str, Any]]) -> torch.Tensor:
    """Unmasked tokens of the step over all micro-batches and DP ranks, on every pipeline stage (the loss, and
    so the count, exists on the last stage only: it is broadcast from there)."""
    count = torch.zeros((), dtype=torch.float64, device=get_device())
    if state.is_pipeline_last_stage():
        count += sum(float(entry[NUM_TOKENS_KEY]) for entry in reduced)
    if not dist.is_initialized():
        return count
    if state.get_pipeline_model_parallel_world_size() > 1:
        last = state.get_pipeline_model_parallel_ranks()[-1]
        dist.broadcast(count, src=last, group=state.get_pipeline_model_parallel_group())
    if state.get_data_parallel_world_size() > 1:
        dist.all_reduce(count, group=state.get_data_parallel_group())
    return count


def scale_grads_to_per_token_loss(
    model: list[nn.Module], reduced: list[dict[str, Any]], num_micro_batches: int
) -> None:
    """Turn grads of mean(micro-batch loss sums) averaged over DP into grads of sum(losses) / sum(tokens)."""
    dp_size = state.get_data_parallel_world_size() if dist.is_initialized() else 1
    factor = num_micro_batches * dp_size / max(global_num_tokens(reduced).item(), 1.0)
    for chunk in model:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grad.mul_(factor)
