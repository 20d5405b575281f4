"""Cross entropy over vocabulary-parallel logits: each TP rank holds logits for its vocabulary slice, and only
per-token scalars (max, sum of exponentials, target logit) cross the TP group, never the full logits.

The logits are the largest activation of a GPT step ([tokens, vocab]); on a CPU each fresh buffer of that
size costs more in page faults than a pass over it, so the loss allocates one fp32 buffer and works in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_train.parallel import state


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if state.group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_size: int | None,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        vocab_per_rank = logits.shape[-1]
        vocab_start = state.group_rank(group) * vocab_per_rank
        # Columns of padding rows (ids >= vocab_size) this rank owns: they take no part in the softmax.
        valid = (
            vocab_per_rank if vocab_size is None else min(max(vocab_size - vocab_start, 0), vocab_per_rank)
        )
        if valid > 0:
            logits_max = logits[..., :valid].max(dim=-1, keepdim=True).values.float()
        else:
            logits_max = torch.full((*logits.shape[:-1], 1), -torch.inf, device=logits.device)
        _all_reduce(logits_max, dist.ReduceOp.MAX, group)
        # Type promotion makes this the loss's one fp32 buffer, upcasting bf16/fp16 logits in the same pass.
        shifted = logits - logits_max
        shifted[..., valid:] = -torch.inf

        outside = (target < vocab_start) | (target >= vocab_start + vocab_per_rank)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        _all_reduce(target_logit, dist.ReduceOp.SUM, group)

        exp_logits = shifted.exp_()  # in place from here on
        sum_exp = exp_logits.sum(dim=-1, keepdim=True)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)

        loss = sum_exp.squeeze(-1).log() - target_logit
        softmax = exp_logits.div_(sum_exp)
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # d loss / d logits = softmax - one_hot(target), built in the saved softmax's buffer (single backward).
        grad, local_target, outside = ctx.saved_tensors
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token fp32 loss [...] from this rank's logits [..., padded vocab / TP] (any float dtype) and global
    target ids [...]. Computed in fp32 whatever the logits' dtype, as Megatron does; the gradient has the logits'
    dtype. Given the true `vocab_size`, the padding columns are left out of the softmax (they get zero
    probability and zero gradient), so the loss does not depend on how much padding the TP size adds
    (docs/architecture.md, vocabulary padding). The vocabulary is split over `tp_group` (default
    parallel.state's tensor-parallel group).
    """
    return _VocabParallelCrossEntropy.apply(
        logits, target, vocab_size, state.tensor_group_or_default(tp_group)
    )
