"""One generation forward step on this rank's pipeline stage, and what the last stage tells the others.

Megatron's text_generation/forward_step.py and communication.py: under pipeline parallelism each stage takes
the previous stage's hidden states, runs its layers with its own KV cache and hands its output on; only the
last stage has logits. It samples, and the tokens it picked (or a beam search's choices, or the logprobs) are
broadcast from it to every rank of the model replica, so all ranks keep the same token buffer and stop at the
same step. Without model parallelism every function here is the plain single-process call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_train.device import get_device
from megatron_train.models.kv_cache import KVCache
from megatron_train.parallel import state
from megatron_train.parallel.p2p import P2PCommunicator


def _model_parallel_size() -> int:
    return state.get_tensor_model_parallel_world_size() * state.get_pipeline_model_parallel_world_size()


def forward_step(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    kv_cache: KVCache | None,
    labels: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Logits [b, s, padded vocab] of the new `tokens` [b, s] on the last stage, or with `labels` [b, s] the
    per-token losses [b, s] (zero-shot evaluation); None on the other stages, which pass their hidden states
    [s, b, h] to the next stage."""
    scored = {} if labels is None else {"labels": labels}  # a generation-only model takes no labels
    if state.get_pipeline_model_parallel_world_size() == 1:
        return model(tokens, position_ids=position_ids, kv_cache=kv_cache, **scored)
    dtype = next(model.parameters()).dtype
    shape = (tokens.size(1), tokens.size(0), model.config.hidden_size)
    p2p = P2PCommunicator(shape, dtype, tokens.device)
    model.set_input_tensor(p2p.recv_forward())
    output = model(tokens, position_ids=position_ids, kv_cache=kv_cache, **scored)
    model.set_input_tensor(None)
    if state.is_pipeline_last_stage():
        return output
    p2p.send_forward(output)
    return None


def broadcast_from_last_stage(
    tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The last stage's `tensor` on every rank of this model replica; the other ranks pass a tensor of `shape`
    and `dtype` to overwrite, or None for a new one. The source is the last stage's first TP rank, so TP ranks
    that sampled on their own also end up with one answer."""
    if _model_parallel_size() == 1:
        return tensor
    tensor = torch.empty(shape, dtype=dtype, device=get_device()) if tensor is None else tensor.contiguous()
    source = state.get_pipeline_model_parallel_ranks()[-1] - state.get_tensor_model_parallel_rank()
    dist.broadcast(tensor, source, group=state.get_model_parallel_group())
    return tensor
