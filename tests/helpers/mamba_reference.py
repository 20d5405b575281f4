"""The Mamba-2 recurrence written out position by position: the reference the chunked scan is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sequential_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y [b, l, h, p] and the final state [b, h, p, n] of state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T,
    y_t = state_t C_t + D x_t (fp64), the state zeroed where `seq_idx` changes; dt is used as given."""
    x, dt, A, B, C, D = (t.double() for t in (x, dt, A, B, C, D))
    batch, length, heads, head_dim = x.shape
    per_group = heads // B.shape[2]
    state = (
        torch.zeros(batch, heads, head_dim, B.shape[3], dtype=torch.float64)
        if initial_state is None
        else initial_state.double().clone()
    )
    ys = []
    for t in range(length):
        if seq_idx is not None and t > 0:
            state = state * (seq_idx[:, t] == seq_idx[:, t - 1]).double()[:, None, None, None]
        for h in range(heads):
            g = h // per_group
            decay = torch.exp(dt[:, t, h] * A[h])[:, None, None]
            state[:, h] = (
                decay * state[:, h] + dt[:, t, h, None, None] * x[:, t, h, :, None] * B[:, t, g, None, :]
            )
        y = torch.stack(
            [
                (state[:, h] * C[:, t, h // per_group, None, :]).sum(-1) + D[h] * x[:, t, h]
                for h in range(heads)
            ],
            dim=1,
        )
        ys.append(y)
    return torch.stack(ys, dim=1), state


def random_scan_inputs(
    batch: int, length: int, heads: int, head_dim: int, groups: int, state: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random fp32 inputs of a scan: decays between exp(-1.6) and 1 per step, B and C of unit scale."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return {
        "x": randn(batch, length, heads, head_dim),
        "dt": F.softplus(randn(batch, length, heads) - 1.0),
        "A": -torch.rand(heads, generator=generator) * 2 - 0.1,
        "B": randn(batch, length, groups, state),
        "C": randn(batch, length, groups, state),
        "D": randn(heads),
    }
