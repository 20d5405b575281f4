"""Causal self-attention over a sequence split across the context-parallel group (`--context-parallel-size`).

Every rank holds its two chunks of the sequence (`parallel.context_parallel`: chunks r and 2 CP - 1 - r) with
their queries, keys and values, RoPE already applied by position. Three ways to reach the other ranks' keys
(`--cp-comm-type`, as Megatron-Core / TransformerEngine name them):

- `p2p`, ring attention: CP steps; at each, this rank attends to the key/value block it holds while the block
  travels on to the next rank (isend/irecv posted before the compute, waited after). The partial results of the
  blocks are merged with the online-softmax rule (flash attention's: outputs rescaled by their log-sum-exps). The
  backward runs the ring again with the gradients of each block's keys and values travelling with it, home after
  CP hops. Of each (query chunk, key chunk) pair only those the causal mask leaves anything of are computed:
  a key chunk after the query chunk is skipped, the diagonal is causal, an earlier one full. Bytes sent per rank
  and layer: (CP - 1) blocks of keys and values forward, as many backward plus CP blocks of their fp32 gradients
  (`ring_bytes_per_rank`).
- `all_gather`: keys and values all-gathered along the sequence (their gradients reduce-scattered back); each
  rank attends with its queries to the whole sequence.
- `a2a` (DeepSpeed Ulysses): an all-to-all trades the sequence split for a head split, attention runs over the
  whole sequence for heads / CP heads, and a second all-to-all trades back. The query groups of a TP rank must
  divide by CP.

Document masks (--reset-attention-mask) travel as the document ids of the whole sequence
(`ContextParallelDocuments`), from which each block's mask is built. The block arithmetic is plain torch
(fp32 scores and softmax), device-agnostic; attention dropout is refused under context parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_train.parallel.context_parallel import (
    RingExchange,
    all_rank_indices,
    chunk_indices,
    gather_sequence,
    heads_to_sequence,
    sequence_to_heads,
)

_KV_TAG, _GRAD_TAG = 7, 8  # the ring's two messages between the same pair of ranks


@dataclass(frozen=True)
class ContextParallelDocuments:
    """The attention mask of a context-parallel layer with documents: the document id of every token of the whole
    sequence ([b, S], global order); a query attends to the keys of its own document up to itself."""

    document_ids: torch.Tensor


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    comm_type: str,
    documents: ContextParallelDocuments | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries q [b, s, heads, d] over the whole sequence's keys, of which this
    rank holds k, v [b, s, groups, d]; returns the context [s, b, heads, d]. `comm_type`: p2p, all_gather or a2a."""
    if documents is not None and not isinstance(documents, ContextParallelDocuments):
        raise TypeError(
            "context-parallel attention takes the documents of the whole sequence (ContextParallelDocuments), "
            f"not a dense mask ({type(documents).__name__})"
        )
    document_ids = None if documents is None else documents.document_ids
    scale = q.shape[-1] ** -0.5
    if comm_type == "p2p":
        context = _RingAttention.apply(q, k, v, document_ids, group, scale)
    elif comm_type == "all_gather":
        context = _all_gather_attention(q, k, v, document_ids, group)
    elif comm_type == "a2a":
        context = _all_to_all_attention(q, k, v, document_ids, group)
    else:
        raise ValueError(f"--cp-comm-type {comm_type}: choose p2p, all_gather or a2a")
    return context.transpose(0, 1)


def ring_bytes_per_rank(
    micro_batch: int, seq_length: int, cp: int, groups_per_rank: int, head_dim: int, element_size: int
) -> tuple[int, int]:
    """Bytes one rank sends in one layer's ring attention, (forward, backward): the forward passes its key/value
    block CP - 1 times; the backward passes it as often plus CP blocks of fp32 key/value gradients."""
    block = 2 * micro_batch * (seq_length // cp) * groups_per_rank * head_dim
    return (cp - 1) * block * element_size, (cp - 1) * block * element_size + cp * block * 4


# -- p2p: ring attention --------------------------------------------------------------------------------------


def _block_mask(
    query_chunk: int, key_chunk: int, size: int, document_ids: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """bool [b or 1, size, size] of one (query chunk, key chunk) pair, True where attended; None: all of it."""
    mask = None
    if query_chunk == key_chunk:
        mask = torch.ones(size, size, dtype=torch.bool, device=device).tril().unsqueeze(0)
    if document_ids is not None:
        queries = document_ids[:, query_chunk * size : (query_chunk + 1) * size]
        keys = document_ids[:, key_chunk * size : (key_chunk + 1) * size]
        same = queries[:, :, None] == keys[:, None, :]
        mask = same if mask is None else mask & same
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """fp32 scores [b, groups, heads per group, s_q, s_k] of q [b, s_q, g, h, d] and k [b, s_k, g, d]."""
    scores = torch.einsum("bqghd,bkgd->bghqk", q.float(), k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None], -torch.inf)
    return scores


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """softmax numerators over the row's final log-sum-exp `lse`; 0 where masked (rows of no key included)."""
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0)


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's normalised output [b, s_q, g, h, d] (fp32) and log-sum-exp [b, g, h, s_q]."""
    scores = _scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bghqk,bkgd->bqghd", _probabilities(scores, lse), v.float())
    return out, lse


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: the output and log-sum-exp of the union of two sets of keys from those of each."""
    merged = torch.logaddexp(lse, block_lse)
    old = torch.exp(lse - merged).nan_to_num(0.0).permute(0, 3, 1, 2)[..., None]
    new = torch.exp(block_lse - merged).nan_to_num(0.0).permute(0, 3, 1, 2)[..., None]
    return out * old + block_out * new, merged


def _block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash attention's backward of one block: (dq, dk, dv) in fp32 from the rows' final log-sum-exp `lse` and
    `delta` = rowsum(grad_out * out)."""
    p = _probabilities(_scores(q, k, mask, scale), lse)
    grad_v = torch.einsum("bghqk,bqghd->bkgd", p, grad_out)
    grad_p = torch.einsum("bqghd,bkgd->bghqk", grad_out, v.float())
    grad_s = p * (grad_p - delta[..., None])
    grad_q = torch.einsum("bghqk,bkgd->bqghd", grad_s, k.float()) * scale
    grad_k = torch.einsum("bghqk,bqghd->bkgd", grad_s, q.float()) * scale
    return grad_q, grad_k, grad_v


def _block_pairs(rank: int, owner: int, cp: int) -> list[tuple[int, int, int, int]]:
    """(local query half, key half, query chunk, key chunk) of the pairs rank `rank` computes with the block of
    rank `owner`: those where the key chunk is not after the query chunk."""
    chunks = lambda r: (r, 2 * cp - 1 - r)  # noqa: E731 - the two chunks a rank holds
    return [
        (qi, ki, qc, kc)
        for qi, qc in enumerate(chunks(rank))
        for ki, kc in enumerate(chunks(owner))
        if kc <= qc
    ]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        document_ids: torch.Tensor | None,
        group: dist.ProcessGroup,
        scale: float,
    ) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        b, s, heads, d = q.shape
        groups = k.shape[2]
        size = s // 2
        grouped_q = q.reshape(b, s, groups, heads // groups, d)
        out = torch.zeros(grouped_q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((b, groups, heads // groups, s), -torch.inf, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            exchange = RingExchange(kv, group, _KV_TAG) if step < cp - 1 else None
            for qi, ki, qc, kc in _block_pairs(rank, (rank - step) % cp, cp):
                rows, keys = slice(qi * size, (qi + 1) * size), slice(ki * size, (ki + 1) * size)
                mask = _block_mask(qc, kc, size, document_ids, q.device)
                block_out, block_lse = _block_forward(
                    grouped_q[:, rows], kv[0][:, keys], kv[1][:, keys], mask, scale
                )
                out[:, rows], lse[..., rows] = _merge(out[:, rows], lse[..., rows], block_out, block_lse)
            if exchange is not None:
                kv = exchange.wait()
        context = out.to(q.dtype).view(b, s, heads, d)
        ctx.save_for_backward(q, k, v, context, lse, document_ids)
        ctx.group, ctx.scale = group, scale
        return context

    @staticmethod
    def backward(ctx, grad_context: torch.Tensor):
        q, k, v, context, lse, document_ids = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        b, s, heads, d = q.shape
        groups = k.shape[2]
        size = s // 2
        shape = (b, s, groups, heads // groups, d)
        grouped_q, grad_out = q.reshape(shape), grad_context.float().reshape(shape)
        delta = (grad_out * context.float().reshape(shape)).sum(-1).permute(0, 2, 3, 1)  # [b, g, h, s]
        grad_q = torch.zeros(shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for step in range(cp):
            exchange = RingExchange(kv, group, _KV_TAG) if step < cp - 1 else None
            for qi, ki, qc, kc in _block_pairs(rank, (rank - step) % cp, cp):
                rows, keys = slice(qi * size, (qi + 1) * size), slice(ki * size, (ki + 1) * size)
                mask = _block_mask(qc, kc, size, document_ids, q.device)
                dq, dk, dv = _block_backward(
                    grouped_q[:, rows], kv[0][:, keys], kv[1][:, keys], grad_out[:, rows], lse[..., rows],
                    delta[..., rows], mask, scale,
                )  # fmt: skip
                grad_q[:, rows] += dq
                grad_kv[0][:, keys] += dk
                grad_kv[1][:, keys] += dv
            # the block's gradient follows its keys and values; after CP hops it is back with its owner, whole
            grad_kv = RingExchange(grad_kv, group, _GRAD_TAG).wait()
            if exchange is not None:
                kv = exchange.wait()
        grad_k, grad_v = grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype)
        return grad_q.to(q.dtype).reshape(b, s, heads, d), grad_k, grad_v, None, None, None


# -- all_gather and a2a: attention over the whole sequence ----------------------------------------------------


def _sequence_mask(
    query_index: torch.Tensor, key_index: torch.Tensor, document_ids: torch.Tensor | None
) -> torch.Tensor:
    """bool [b or 1, 1, s_q, s_k]: causal over global positions, within documents."""
    mask = (key_index[None, :] <= query_index[:, None]).unsqueeze(0)
    if document_ids is not None:
        mask = mask & (document_ids[:, query_index, None] == document_ids[:, None, key_index])
    return mask.unsqueeze(1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[b, s_q, heads, d] attention over k, v [b, s_k, groups, d] under `mask` (None: causal, s_q == s_k)."""
    heads_per_group = q.shape[2] // k.shape[2]
    if heads_per_group > 1:
        k, v = k.repeat_interleave(heads_per_group, dim=2), v.repeat_interleave(heads_per_group, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return context.transpose(1, 2)


def _all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor | None,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_length = q.shape[1] * cp
    query_index = chunk_indices(seq_length, cp, rank, q.device)
    key_index = all_rank_indices(seq_length, cp, q.device)
    mask = _sequence_mask(query_index, key_index, document_ids)
    return _sdpa(q, gather_sequence(k, group), gather_sequence(v, group), mask)


def _all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor | None,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    cp = dist.get_world_size(group)
    if k.shape[2] % cp:
        raise ValueError(
            f"--cp-comm-type a2a splits the attention heads over --context-parallel-size {cp}, but a tensor-parallel "
            f"rank holds {k.shape[2]} key/value heads (query groups); use --cp-comm-type p2p or all_gather"
        )
    seq_length = q.shape[1] * cp
    order = all_rank_indices(seq_length, cp, q.device)  # gathered position -> global position
    natural = torch.argsort(order)  # global position -> gathered position
    q, k, v = (sequence_to_heads(t, group)[:, natural] for t in (q, k, v))
    positions = torch.arange(seq_length, device=q.device)
    mask = None if document_ids is None else _sequence_mask(positions, positions, document_ids)
    context = _sdpa(q, k, v, mask)[:, order]
    return heads_to_sequence(context.contiguous(), group)
