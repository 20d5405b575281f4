"""Token dispatchers (Megatron-Core's MoEAllGatherTokenDispatcher and MoEAlltoAllTokenDispatcher): they bring each
routed token to the rank holding its expert, grouped by local expert, and bring the experts' outputs back,
weighted by the routing probabilities and summed per token.

Both keep the same contract: `dispatch(hidden [T, h], probs [T, E], routing_map [T, E])` returns the local
experts' input [N, h] (expert after expert) and how many rows each local expert has; `combine(output [N, h])`
returns [T, h] in the input's order. An expert's output may be a partial sum over its expert-tensor-parallel
(ETP) ranks (the row-parallel second linear layer); combining sums it.

- allgather: every rank of the ETP x EP group gathers all the group's tokens, runs its local experts on those
  routed to them, and a reduce-scatter returns each rank the sum over experts of its own tokens.
- alltoall: each rank sends each token only to the EP rank of each of its experts (all_to_all with per-rank split
  sizes), the ETP ranks of an expert then gather what each received; combining reverses both steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_train.models.moe.comm import (
    all_to_all,
    gather_along_first_dim,
    reduce_scatter_along_first_dim,
)
from megatron_train.parallel import state


@dataclass
class Routes:
    """Where `permute` put the (token, expert) pairs: the source token of each expert-major row, its routing weight,
    and when every token has the same number k of pairs (dropless routing), `rows` [tokens, k]: the rows of each
    token's pairs, experts in ascending order (None otherwise)."""

    token_ids: torch.Tensor
    probs: torch.Tensor
    num_tokens: int
    rows: torch.Tensor | None


def _rows_of_tokens(routing_map: torch.Tensor) -> torch.Tensor | None:
    """`Routes.rows` of `routing_map` [T, E], or None when tokens have different numbers of experts."""
    per_token = routing_map.sum(dim=1)
    if routing_map.shape[0] == 0 or not bool((per_token == per_token[0]).all()) or not int(per_token[0]):
        return None
    routes = routing_map.long()
    per_expert = routes.sum(dim=0)
    first_row = per_expert.cumsum(0) - per_expert  # of each expert's block
    return (first_row + routes.cumsum(dim=0) - 1)[routing_map].view(routing_map.shape[0], -1)


def _sum_rows_per_token(rows: torch.Tensor, token_rows: torch.Tensor) -> torch.Tensor:
    """[tokens, h]: each token's rows summed, in the order index_add would add them."""
    gathered = rows.index_select(0, token_rows.view(-1))
    return gathered.view(*token_rows.shape, rows.shape[-1]).sum(dim=1)


class _GatherRows(torch.autograd.Function):
    """tokens -> their expert-major rows; the gradient sums each token's rows by gathering them (`Routes.rows`),
    not by index_add (one scatter per row on CPU)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, routes: Routes) -> torch.Tensor:
        ctx.routes = routes
        return tokens.index_select(0, routes.token_ids)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _sum_rows_per_token(grad, ctx.routes.rows), None


class _SumRowsPerToken(torch.autograd.Function):
    """Expert-major rows -> each token's sum of them (the adjoint of _GatherRows)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, routes: Routes) -> torch.Tensor:
        ctx.routes = routes
        return _sum_rows_per_token(rows, routes.rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.index_select(0, ctx.routes.token_ids), None


def permute(
    tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
) -> tuple[torch.Tensor, Routes]:
    """(the rows of `tokens` routed to each expert, expert after expert and in token order within an expert;
    their routes)."""
    expert_major = routing_map.t()
    token_ids = expert_major.nonzero(as_tuple=True)[1]
    routes = Routes(token_ids, probs.t()[expert_major], tokens.shape[0], _rows_of_tokens(routing_map))
    if routes.rows is None:
        return tokens.index_select(0, token_ids), routes
    return _GatherRows.apply(tokens, routes), routes


def unpermute(permuted: torch.Tensor, routes: Routes) -> torch.Tensor:
    """Inverse of `permute`: each row weighted by its routing weight and added into its token's row."""
    weighted = permuted * routes.probs.unsqueeze(-1).to(permuted.dtype)
    if routes.rows is not None:
        return _SumRowsPerToken.apply(weighted, routes)
    out = permuted.new_zeros((routes.num_tokens, permuted.shape[-1]))
    return out.index_add(0, routes.token_ids, weighted)


@dataclass
class _Dispatched:
    """What combine needs from dispatch."""

    routes: Routes
    chunk_sizes: list[int] | None = None  # alltoall: rows per (ETP rank, EP rank, local expert) chunk
    received: list[int] | None = None  # alltoall: rows each ETP rank received through the all-to-all
    input_splits: list[int] | None = None
    output_splits: list[int] | None = None


class TokenDispatcher:
    """Base of both dispatchers: `num_local_experts` experts starting at global index `first_expert` on this
    rank (its EP rank's), the `ep_size` x `etp_size` ranks of `pg_collection`'s EP and ETP groups exchanging
    tokens."""

    def __init__(self, num_experts: int, pg_collection: state.ProcessGroupCollection) -> None:
        self.ep_group, self.etp_group, self.tp_ep_group = (
            pg_collection.ep,
            pg_collection.expt_tp,
            pg_collection.tp_ep,
        )
        self.ep_size, self.etp_size = state.group_size(self.ep_group), state.group_size(self.etp_group)
        self.etp_rank = state.group_rank(self.etp_group)
        self.num_local_experts = num_experts // self.ep_size
        self.first_expert = state.group_rank(self.ep_group) * self.num_local_experts
        self._saved: _Dispatched | None = None

    def dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        raise NotImplementedError

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class AllGatherDispatcher(TokenDispatcher):
    """Megatron's allgather dispatcher over the ETP x EP group (every rank holds the same number of tokens)."""

    def dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        group = self.tp_ep_group
        hidden_all = gather_along_first_dim(group, hidden)
        probs_all = gather_along_first_dim(group, probs)
        with torch.no_grad():
            map_all = gather_along_first_dim(group, routing_map.to(torch.uint8)).bool()
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        local_map = map_all[:, local]
        tokens, routes = permute(hidden_all, local_map, probs_all[:, local])
        self._saved = _Dispatched(routes)
        return tokens, local_map.sum(dim=0).tolist()

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        saved, self._saved = self._saved, None
        summed = unpermute(expert_output, saved.routes)
        return reduce_scatter_along_first_dim(self.tp_ep_group, summed)


class AlltoAllDispatcher(TokenDispatcher):
    """Megatron's alltoall dispatcher: all-to-all over EP, then all-gather over ETP, then the rows sorted by local
    expert; the per-rank counts (a small all-gather over ETP x EP) give every split size."""

    def dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        tokens, routes = permute(hidden, routing_map, probs)
        with torch.no_grad():  # [EP rank, ETP rank, expert]: tokens each rank routes to each expert
            counts = gather_along_first_dim(self.tp_ep_group, routing_map.sum(dim=0, keepdim=True))
        counts = counts.view(self.ep_size, self.etp_size, -1).tolist()
        ep_rank, etp_rank = self.first_expert // self.num_local_experts, self.etp_rank
        per_rank = self.num_local_experts

        def local(row: list[int]) -> list[int]:
            return row[self.first_expert : self.first_expert + per_rank]

        mine = counts[ep_rank][etp_rank]
        input_splits = [sum(mine[r * per_rank : (r + 1) * per_rank]) for r in range(self.ep_size)]
        output_splits = [sum(local(counts[r][etp_rank])) for r in range(self.ep_size)]
        received = all_to_all(self.ep_group, tokens, output_splits, input_splits)
        sizes = [sum(sum(local(counts[r][t])) for r in range(self.ep_size)) for t in range(self.etp_size)]
        gathered = gather_along_first_dim(self.etp_group, received, sizes)
        # chunks arrive ETP rank by ETP rank, then EP rank, then local expert: sort them expert-major
        chunk_sizes = [
            n for t in range(self.etp_size) for r in range(self.ep_size) for n in local(counts[r][t])
        ]
        self._saved = _Dispatched(routes, chunk_sizes, sizes, input_splits, output_splits)
        tokens_per_expert = [sum(chunk_sizes[e::per_rank]) for e in range(per_rank)]
        if len(chunk_sizes) == per_rank:  # one source rank: already expert after expert
            return gathered, tokens_per_expert
        chunks = gathered.split(chunk_sizes)
        return torch.cat([chunks[c] for c in self._expert_major(len(chunks))]), tokens_per_expert

    def _expert_major(self, num_chunks: int) -> list[int]:
        """The chunks (source rank major, local expert minor) in expert-major order."""
        per_rank = self.num_local_experts
        return [c for e in range(per_rank) for c in range(e, num_chunks, per_rank)]

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        saved, self._saved = self._saved, None
        num_chunks = len(saved.chunk_sizes)
        if num_chunks == self.num_local_experts:
            unsorted = expert_output
        else:
            order = self._expert_major(num_chunks)
            pieces = expert_output.split([saved.chunk_sizes[c] for c in order])
            by_chunk = [None] * num_chunks
            for piece, c in zip(pieces, order, strict=True):
                by_chunk[c] = piece
            unsorted = torch.cat(by_chunk)
        reduced = reduce_scatter_along_first_dim(self.etp_group, unsorted, saved.received)
        returned = all_to_all(self.ep_group, reduced, saved.input_splits, saved.output_splits)
        return unpermute(returned, saved.routes)


DISPATCHERS = {"allgather": AllGatherDispatcher, "alltoall": AlltoAllDispatcher}
