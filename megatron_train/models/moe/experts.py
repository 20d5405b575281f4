"""The local experts of an MoE layer: each an MLP (h -> ffn -> h, SwiGLU or GELU as the dense MLP), all of them held
in two 3-D weights, Megatron's GroupedMLP layout: `weight1` [local experts, h, ffn (x2 for SwiGLU) / ETP] and
`weight2` [local experts, ffn / ETP, h].

One weight per linear layer, whatever runs them: `--moe-grouped-gemm` multiplies every local expert's rows in one
call per layer, on CPU one `torch.bmm` over the rows padded to the busiest expert's (while padding adds at most a
quarter more rows: torch's CPU grouped_mm is one multi-threaded mm per expert), else one
`torch.nn.functional.grouped_mm` (`Experts.kernel`); without it (or where grouped_mm cannot run:
`grouped_mm_refusal`) a loop runs the experts one after another on the same weights. The checkpoint holds the weights of all the
layer's experts stacked on the first axis, so any expert-parallel layout loads them (docs/architecture.md).

Initialisation follows `parallel.param_init`: by default each rank draws only its experts' shards, on the tracked
expert stream of its (EP, ETP) rank when the experts are split (Megatron's expert-parallel-rng; the default
generator on one rank), so a model built on the meta device never holds another rank's experts. Under
--use-cpu-initialization each expert's full weight is drawn in turn from the layer's stream and this rank keeps its
experts and ETP slice: every (EP, ETP) layout starts from the same experts, holding one master weight at a time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.init import init_method_normal, scaled_init_method_normal
from megatron_train.models.mlp import activation
from megatron_train.parallel import state
from megatron_train.parallel.layers import divide
from megatron_train.parallel.param_init import new_parameter
from megatron_train.parallel.random import EXPERT_PARALLEL_RNG, full_weight_initialization

logger = logging.getLogger(__name__)

# --moe-grouped-gemm on CPU pads the experts' rows for one bmm while that adds at most a quarter more rows
PADDED_ROWS_LIMIT = 1.25


def grouped_mm_refusal(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why `grouped_mm(x, weight)` cannot run here (None when it can): its kernels need every row of both operands
    to start on a 16-byte boundary, and on CUDA bf16 operands (torch 2.13; on CPU every float dtype runs)."""
    if hasattr(F, "grouped_mm") is False:
        return "this torch has no torch.nn.functional.grouped_mm"
    if x.is_cuda and x.dtype != torch.bfloat16:
        return f"grouped_mm on CUDA takes bf16, the experts are {x.dtype}"
    for tensor in (x, weight):
        if (tensor.shape[-1] * tensor.element_size()) % 16:
            return f"a row of {tensor.shape[-1]} {tensor.dtype} values is not a multiple of 16 bytes"
    return None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (grouped_mm's backward refuses a broadcast one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _ToSlots(torch.autograd.Function):
    """rows [N, h] -> [num_slots, h] holding row i at slots[i] and zeros elsewhere; the gradient gathers them back
    (indexing's own backward would scatter-add, one parallel loop per row on CPU)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, slots: torch.Tensor, num_slots: int) -> torch.Tensor:
        ctx.save_for_backward(slots)
        return rows.new_zeros(num_slots, rows.shape[-1]).index_copy_(0, slots, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (slots,) = ctx.saved_tensors
        return grad.index_select(0, slots), None, None


class _FromSlots(torch.autograd.Function):
    """[num_slots, h] -> its rows at `slots` (the adjoint of _ToSlots)."""

    @staticmethod
    def forward(ctx, padded: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slots)
        ctx.num_slots = padded.shape[0]
        return padded.index_select(0, slots)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (slots,) = ctx.saved_tensors
        return _ToSlots.apply(grad, slots, ctx.num_slots), None


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e - 1]:offsets[e] of `x` [N, k] times weight[e] [k, n], for every e, in one kernel."""
    return _ContiguousGrad.apply(F.grouped_mm(x, weight, offs=offsets))


def expert_weight(
    num_experts: int,
    local: range,
    etp_group: dist.ProcessGroup | None,
    shape: tuple[int, ...],
    init: Callable[[torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
    partition_dim: int | None = None,
    stride: int = 1,
) -> nn.Parameter:
    """[local experts, *shape] with dim `partition_dim` of `shape` cut over the ETP ranks of `etp_group` (None: not
    cut), in `stride` interleaved chunks (SwiGLU's [gate; up]), as a tensor-parallel weight is. Drawn as this rank's
    shard (on the expert stream when EP x ETP splits it), or under --use-cpu-initialization by drawing each of the
    layer's `num_experts` experts in full in turn (the same draws on every rank) and keeping this rank's `local`
    experts' slices (module docstring)."""
    etp, etp_rank = state.group_size(etp_group), state.group_rank(etp_group)
    local_shape = list(shape)
    if partition_dim is not None:
        chunk = divide(shape[partition_dim], etp * stride, "the expert hidden size (--moe-ffn-hidden-size)")
        local_shape[partition_dim] = chunk * stride
    if not full_weight_initialization():
        split = num_experts // len(local) * (etp if partition_dim is not None else 1) > 1
        weight = new_parameter(
            (len(local), *local_shape), dtype, init, tensor_parallel=split, stream=EXPERT_PARALLEL_RNG
        )
    else:
        kept = []
        for expert in range(num_experts):
            master = init(torch.empty(shape, dtype=torch.float32, device="cpu"))
            if expert in local and partition_dim is not None:
                kept.append(
                    torch.cat(master.split(chunk, dim=partition_dim)[etp_rank::etp], dim=partition_dim)
                )
            elif expert in local:
                kept.append(master)
        weight = nn.Parameter(torch.stack(kept).to(dtype).contiguous())
    weight.allreduce = False  # Megatron's mark of an expert parameter: reduced over expert data parallel
    weight.tensor_model_parallel = partition_dim is not None  # over the ETP ranks
    weight.partition_dim = -1 if partition_dim is None else partition_dim + 1
    weight.partition_stride = stride
    return weight


class Experts(nn.Module):
    """This rank's `num_experts / EP` experts of one MoE layer (global indices `local_experts`), split over the EP
    and ETP groups of `pg_collection`."""

    def __init__(self, config: TransformerConfig, pg_collection: state.ProcessGroupCollection) -> None:
        super().__init__()
        per_rank = divide(config.num_experts, state.group_size(pg_collection.ep), "--num-experts")
        first = state.group_rank(pg_collection.ep) * per_rank
        self.local_experts = range(first, first + per_rank)
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        fc1 = 2 * ffn if config.swiglu else ffn
        stride = 2 if config.swiglu else 1
        self.grouped_gemm = config.moe_grouped_gemm
        self.activation = activation(config)
        init = init_method_normal(config.init_method_std)
        out_init = scaled_init_method_normal(config.init_method_std, config.num_layers)
        weight = functools.partial(
            expert_weight,
            config.num_experts,
            self.local_experts,
            pg_collection.expt_tp,
            dtype=config.params_dtype,
        )
        self.weight1 = weight((hidden, fc1), init, partition_dim=1, stride=stride)
        self.weight2 = weight((ffn, hidden), out_init, partition_dim=0)
        self.bias1 = self.bias2 = None
        if config.add_bias_linear:  # refused with ETP > 1 (arguments.validate_config), as Megatron
            self.bias1 = weight((fc1,), nn.init.zeros_, partition_dim=0, stride=stride)
            self.bias2 = weight((hidden,), nn.init.zeros_)
        self.padded_rows_limit = PADDED_ROWS_LIMIT
        self._refusal_logged = False

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """tokens [N, h], the rows of local expert e after those of e - 1 -> outputs [N, h] (partial sums over the
        ETP ranks)."""
        run = {"bmm": self._batched, "grouped_mm": self._grouped, "loop": self._sequential}
        return run[self.kernel(tokens, tokens_per_expert)](tokens, tokens_per_expert)

    def kernel(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> str:
        """How the experts run on these rows. With --moe-grouped-gemm: on CPU one `bmm` over the rows padded to the
        busiest expert's while that adds at most `padded_rows_limit` - 1 more rows (torch's CPU grouped_mm runs one
        multi-threaded mm per expert, several times slower than one bmm of the same rows on a loaded machine:
        benchmarks/moe.py), else `grouped_mm` where it can run; otherwise a `loop` over the experts."""
        if not self.grouped_gemm or tokens.shape[0] == 0:
            return "loop"
        padded_rows = len(tokens_per_expert) * max(tokens_per_expert)
        if tokens.device.type == "cpu" and padded_rows <= self.padded_rows_limit * tokens.shape[0]:
            return "bmm"
        refusal = grouped_mm_refusal(tokens, self.weight1)
        if refusal is None:
            return "grouped_mm"
        if not self._refusal_logged:
            logger.warning("--moe-grouped-gemm: %s; the experts run one after another", refusal)
            self._refusal_logged = True
        return "loop"

    def _batched(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """Every expert's rows in one slot of [experts, busiest expert's rows, h] (zeros after its own), one bmm
        per linear layer; the padding rows' outputs are dropped, so their gradients are zero."""
        experts, busiest = len(tokens_per_expert), max(tokens_per_expert)
        counts = torch.tensor(tokens_per_expert, device=tokens.device)
        filled = torch.arange(busiest, device=tokens.device) < counts.unsqueeze(1)  # [experts, busiest]
        slots = filled.view(-1).nonzero().squeeze(1)
        padded = _ToSlots.apply(tokens, slots, experts * busiest).view(experts, busiest, -1)
        hidden = torch.bmm(padded, self.weight1)
        if self.bias1 is not None:
            hidden = hidden + self.bias1.unsqueeze(1)
        out = torch.bmm(self.activation(hidden), self.weight2)
        if self.bias2 is not None:
            out = out + self.bias2.unsqueeze(1)
        return _FromSlots.apply(out.view(experts * busiest, -1), slots)

    def _grouped(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        counts = torch.tensor(tokens_per_expert, device=tokens.device)
        offsets = counts.cumsum(0).to(torch.int32)
        hidden = grouped_matmul(tokens, self.weight1, offsets)
        if self.bias1 is not None:
            hidden = hidden + self.bias1.repeat_interleave(counts, dim=0, output_size=tokens.shape[0])
        out = grouped_matmul(self.activation(hidden), self.weight2, offsets)
        if self.bias2 is not None:
            out = out + self.bias2.repeat_interleave(counts, dim=0, output_size=tokens.shape[0])
        return out

    def _sequential(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        # unbind: one gradient per weight stacked in the backward (indexing weight1[e] would add a zero-filled
        # gradient of the whole weight per expert)
        weights1, weights2 = self.weight1.unbind(0), self.weight2.unbind(0)
        biases1 = self.bias1.unbind(0) if self.bias1 is not None else None
        biases2 = self.bias2.unbind(0) if self.bias2 is not None else None
        outputs = []
        for e, rows in enumerate(tokens.split(tokens_per_expert)):
            hidden = rows @ weights1[e]
            if biases1 is not None:
                hidden = hidden + biases1[e]
            out = self.activation(hidden) @ weights2[e]
            outputs.append(out if biases2 is None else out + biases2[e])
        return torch.cat(outputs)
