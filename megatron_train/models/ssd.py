"""Mamba-2's selective scan as state space duality (SSD), chunk-wise in pure PyTorch, and its one-step recurrence.

The recurrence, per head h (head dim p, state n), with a_t = dt_t * A_h (A < 0, so exp(a_t) is a decay):

    state_t = exp(a_t) * state_{t-1} + dt_t * x_t B_t^T        [p, n]
    y_t     = state_t C_t + D_h * x_t                          [p]

`ssd_chunk_scan` computes it as the SSD paper's block decomposition: positions are cut into chunks of
`chunk_size`; inside a chunk the outputs are a masked attention-like product (C B^T weighted by the decays), each
chunk's contribution to the state is summed, the states are passed from chunk to chunk, and each position reads
the state its chunk started with. Heads share B and C within a group (`B, C: [b, l, groups, n]`, heads of group g
contiguous), which the products use without repeating B and C per head. All of it runs in fp32 whatever the
input dtype (the SSM state stays fp32 under bf16), and every decay is a sum over the positions it spans, never a
difference of two running sums, so it stays exact in fp32 and a document boundary can be an infinite decay:
`seq_idx` [b, l] (a document number per position) makes the state restart where it changes (Megatron's
`--reset-attention-mask` for Mamba layers, mamba-ssm's `seq_idx`).

`mamba_chunk_scan` is the scan the mixer calls: mamba-ssm's fused Triton kernel (`mamba_chunk_scan_combined`, same
arguments) on CUDA when it is installed, this module's PyTorch scan otherwise (the reference; docs/architecture.md,
Mamba).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: entry [i, j] = a[j + 1] + ... + a[i] for i >= j (0 on the diagonal), -inf above
    it. Each sum is taken over its own positions (a masked cumulative sum), so an -inf decay stays -inf."""
    length = a.shape[-1]
    below = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    sums = a[..., :, None].expand(*a.shape, length).masked_fill(~below, 0.0).cumsum(-2)  # [.., m, j] = a[m]
    return sums.masked_fill(
        ~below.logical_or(torch.eye(length, dtype=torch.bool, device=a.device)), -torch.inf
    )


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool) -> torch.Tensor:
    """The step sizes in fp32: softplus(dt + dt_bias) as Mamba-2 does, or dt as given."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt) if dt_softplus else dt


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    dt_softplus: bool = False,
    return_final_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y [b, l, h, p] (x's dtype) of x [b, l, h, p], dt [b, l, h], A [h], B and C [b, l, g, n], D [h]; with
    `return_final_states` also the fp32 state after the last position [b, h, p, n]. `initial_states` [b, h, p, n]
    is the state before the first position (a cache's). The arguments are mamba-ssm's `mamba_chunk_scan_combined`'s
    (`z`, its gate, is applied by the mixer's norm here, so it must be None)."""
    if z is not None:
        raise ValueError("ssd_chunk_scan takes no gate z: the mixer's gated norm applies it")
    batch, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[2], B.shape[3]
    per_group = heads // groups
    chunk = min(chunk_size, length)
    chunks = -(-length // chunk)
    pad = chunks * chunk - length

    dt = discretize(dt, dt_bias, dt_softplus)
    a = dt * A.float()  # [b, l, h]: log of each step's decay
    xf = x.float()
    x_dt = xf * dt[..., None]

    def chunked(tensor: torch.Tensor) -> torch.Tensor:  # [b, l, ...] -> [b, c, Q, ...], zero-padded
        tensor = F.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, pad))
        return tensor.reshape(batch, chunks, chunk, *tensor.shape[2:])

    # [b, c, g, Q, n] and [b, c, g, e, Q, p] with e the heads of a group: heads share their group's B and C.
    Bc = chunked(B.float()).permute(0, 1, 3, 2, 4)
    Cc = chunked(C.float()).permute(0, 1, 3, 2, 4)
    Xc = chunked(x_dt).reshape(batch, chunks, chunk, groups, per_group, head_dim).permute(0, 1, 3, 4, 2, 5)
    ac = chunked(a).reshape(batch, chunks, chunk, groups, per_group).permute(0, 1, 3, 4, 2)  # [b, c, g, e, Q]

    # Decays are exp(a_{j+1} + ... + a_i): differences of the running sums within a chunk (as mamba-ssm's kernels),
    # taken in fp64 so the subtraction loses nothing; a document boundary between j and i masks the pair.
    running = ac.double().cumsum(-1)  # [b, c, g, e, Q]
    keep = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    documents = None
    if seq_idx is not None:
        padded = torch.cat((seq_idx, seq_idx[:, -1:].expand(-1, pad)), dim=1)  # padding: the last document
        documents = padded.reshape(batch, chunks, chunk)
        keep = keep & (documents[..., :, None] == documents[..., None, :])[:, :, None, None]

    # 1. Within each chunk: y_i += sum_{j <= i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j.
    decay = torch.exp((running[..., :, None] - running[..., None, :]).float().masked_fill(~keep, -torch.inf))
    scores = Cc @ Bc.transpose(-1, -2)  # [b, c, g, Q, Q]
    y = (decay * scores[:, :, :, None]) @ Xc  # [b, c, g, e, Q, p]

    # 2. Each chunk's contribution to the state at its end: sum_j exp(a_{j+1} + ... + a_last) dt_j x_j B_j^T.
    to_end = decay[..., -1, :]  # [b, c, g, e, Q]
    chunk_states = (Xc * to_end[..., None]).transpose(-1, -2) @ Bc[:, :, :, None]  # [b, c, g, e, p, n]

    # 3. The state each chunk starts with: the states passed on from chunk to chunk, decayed by whole chunks (not
    # at all through a chunk where a document starts).
    from_start = torch.exp(running.float())  # [b, c, g, e, Q]: exp(a_first + ... + a_i)
    totals = running[..., -1].float()  # [b, c, g, e]
    if documents is not None:
        before = torch.cat(
            (documents[:, :1, :1], documents[:, :-1, -1:]), dim=1
        )  # the document entering each chunk
        carries = (
            documents == before
        )  # [b, c, Q]: position i still in the document the chunk's state belongs to
        from_start = from_start * carries[:, :, None, None]
        totals = totals.masked_fill(~carries[:, :, -1:, None], -torch.inf)
    if initial_states is None:
        first = chunk_states.new_zeros(batch, 1, groups, per_group, head_dim, state_dim)
    else:
        first = initial_states.float().reshape(batch, 1, groups, per_group, head_dim, state_dim)
    states = torch.cat((first, chunk_states), dim=1)  # [b, c + 1, g, e, p, n]
    passing = torch.exp(segment_sums(F.pad(totals.permute(0, 2, 3, 1), (1, 0))))  # [b, g, e, c + 1, c + 1]
    states = (passing @ states.permute(0, 2, 3, 1, 4, 5).flatten(-2)).unflatten(-1, (head_dim, state_dim))
    start_states, final_state = states[:, :, :, :-1], states[:, :, :, -1]  # [b, g, e, c, p, n]

    # 4. What each position reads of its chunk's start state: exp(a_first + ... + a_i) C_i . state.
    carried = (Cc[:, :, :, None] @ start_states.permute(0, 3, 1, 2, 5, 4)) * from_start[..., None]
    y = (y + carried).permute(0, 1, 4, 2, 3, 5).reshape(batch, chunks * chunk, heads, head_dim)[:, :length]

    if D is not None:
        y = y + xf * D.float()[:, None]
    y = y.to(x.dtype)
    if not return_final_states:
        return y
    return y, final_state.reshape(batch, heads, head_dim, state_dim)


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """One position of the recurrence for a batch (generation with a state cache): updates the fp32 `state`
    [b, h, p, n] in place from x [b, h, p], dt [b, h] (already discretized), B and C [b, g, n]; returns y [b, h, p]
    in x's dtype."""
    batch, heads, head_dim = x.shape
    groups = B.shape[1]
    xf = x.float()
    Bh = B.float().repeat_interleave(heads // groups, dim=1)  # [b, h, n]
    Ch = C.float().repeat_interleave(heads // groups, dim=1)
    decay = torch.exp(dt * A.float())[..., None, None]
    state.mul_(decay).add_((dt[..., None] * xf)[..., None] * Bh[:, :, None, :])
    y = (state @ Ch[..., None]).squeeze(-1) + xf * D.float()[:, None]
    return y.to(x.dtype)


@functools.cache
def _fused_chunk_scan() -> Callable | None:
    """mamba-ssm's fused chunk scan when the package is installed (it needs CUDA and Triton)."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:
        return None
    return mamba_chunk_scan_combined


def mamba_chunk_scan(x: torch.Tensor, *args, **kwargs):
    """`ssd_chunk_scan`'s result, by mamba-ssm's fused kernel for CUDA tensors when it is installed."""
    fused = _fused_chunk_scan() if x.is_cuda else None
    if fused is not None:
        if kwargs.get("seq_idx") is not None:
            kwargs["seq_idx"] = kwargs["seq_idx"].to(torch.int32)
        return fused(x, *args, **kwargs)
    return ssd_chunk_scan(x, *args, **kwargs)
