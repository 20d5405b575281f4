"""The Mamba-2 mixer (Megatron-Core's MambaMixer) and the layers of a hybrid model: Mamba, attention, MLP (or MoE).

The mixer: in-projection to [z, x, B, C, dt] -> causal depthwise convolution (kernel 4) and SiLU over [x, B, C] ->
the selective scan (`models.ssd`) -> RMSNorm of y * SiLU(z) per group of heads (gated, norm after the gate) ->
out-projection. Under tensor parallelism each rank holds its heads and groups (Megatron-Core's split: every part of
the in-projection, of the convolution and of the per-head parameters is split over TP on its own), so the scan
needs no communication; the in-projection gathers the sequence and the out-projection reduce-scatters it under
sequence parallelism. Parameter names follow Megatron-Core's local spec (`mixer.in_proj`, `mixer.conv1d`,
`mixer.A_log`, `mixer.D`, `mixer.dt_bias`, `mixer.norm`, `mixer.out_proj`; the layers' `norm`, `input_layernorm`,
`pre_mlp_layernorm`). Fused kernels (causal-conv1d, mamba-ssm) run on CUDA when installed; the PyTorch code is the
reference and runs everywhere (docs/architecture.md, Mamba).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.init import init_method_normal, scaled_init_method_normal
from megatron_train.models.kv_cache import KVCache
from megatron_train.models.mamba_context_parallel import MambaContextParallel
from megatron_train.models.norms import build_norm
from megatron_train.models.ssd import discretize, mamba_chunk_scan, ssd_step
from megatron_train.models.transformer import MLP, Rotary, SelfAttention
from megatron_train.parallel import state
from megatron_train.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    divide,
    rank_pieces,
    set_tensor_model_parallel_attributes,
    slice_for_rank,
)
from megatron_train.parallel.param_init import new_parameter

CONV_KERNEL = 4  # Megatron-Core's d_conv
CHUNK_SIZE = 128  # Megatron-Core's chunk_size: the scan's result does not depend on it
EXPAND = 2  # d_inner = 2 * hidden size unless --mamba-num-heads says otherwise
GATED_NORM_EPS = 1e-5  # Megatron-Core's fixed epsilon of the mixer's norm
DT_MIN, DT_MAX, DT_INIT_FLOOR, A_INIT_RANGE = 0.001, 0.1, 1e-4, (1.0, 16.0)


def mamba_heads(config: TransformerConfig) -> int:
    """--mamba-num-heads, else 2 * hidden size / --mamba-head-dim (Megatron's default expand of 2)."""
    if config.mamba_num_heads is not None:
        return config.mamba_num_heads
    return divide(
        EXPAND * config.hidden_size, config.mamba_head_dim, "2 x --hidden-size over --mamba-head-dim"
    )


def mamba_shapes(config: TransformerConfig) -> tuple[int, int, int, int]:
    """(heads, d_inner, groups x state dim, conv channels) of the whole mixer."""
    heads = mamba_heads(config)
    d_inner = heads * config.mamba_head_dim
    bc = config.mamba_num_groups * config.mamba_state_dim
    return heads, d_inner, bc, d_inner + 2 * bc


def check_mamba_config(config: TransformerConfig, tp_size: int, cp_size: int = 1) -> None:
    """Refuse a Mamba shape the mixer cannot build, naming the flag (Megatron-Core's asserts, as sentences): heads
    and groups are split over TP, and under context parallelism each TP rank's again over CP."""
    heads = mamba_heads(config)
    if heads % config.mamba_num_groups:
        raise ValueError(
            f"Mamba heads ({heads}: --mamba-num-heads, else 2 x --hidden-size / --mamba-head-dim) must be a "
            f"multiple of --mamba-num-groups {config.mamba_num_groups}"
        )
    divide(heads, tp_size, "Mamba heads (--mamba-num-heads, else 2 x --hidden-size / --mamba-head-dim)")
    divide(config.mamba_num_groups, tp_size, "--mamba-num-groups")
    if cp_size > 1 and (heads % (tp_size * cp_size) or config.mamba_num_groups % (tp_size * cp_size)):
        raise ValueError(
            f"--context-parallel-size {cp_size} splits each tensor-parallel rank's Mamba heads and groups again: "
            f"Mamba heads ({heads}) and --mamba-num-groups ({config.mamba_num_groups}) must divide by "
            f"--tensor-model-parallel-size x --context-parallel-size ({tp_size} x {cp_size}); change one of them"
        )


def _tp_parameter(
    full_shape: tuple[int, ...],
    draw: Callable[[torch.Tensor], Any],
    dtype: torch.dtype,
    tp_group: dist.ProcessGroup | None,
    sizes: list[int] | None = None,
) -> nn.Parameter:
    """This rank's slice along dim 0 of a whole CPU tensor that `draw` fills in place on every rank (the TP=1
    model's, split; these are the mixer's small per-head and per-channel tensors), drawn when the parameter is
    initialised (`param_init.new_parameter`: at once, or when a meta-device model is materialised)."""
    tp_size, tp_rank = state.group_size(tp_group), state.group_rank(tp_group)
    local_shape = list(full_shape)
    local_shape[0] = sum(
        size for _, size in rank_pieces(full_shape[0], tp_size, tp_rank, partition_sizes=sizes)
    )

    def init(tensor: torch.Tensor) -> None:
        full = torch.empty(full_shape, dtype=torch.float32, device="cpu")
        draw(full)
        tensor.copy_(slice_for_rank(full, 0, tp_size, tp_rank, partition_sizes=sizes))

    param = new_parameter(local_shape, dtype, init)
    set_tensor_model_parallel_attributes(param, 0, partition_sizes=sizes)
    return param


def _dt_bias(tensor: torch.Tensor) -> None:
    """dt_bias = softplus^-1(dt), dt log-uniform in [DT_MIN, DT_MAX] (floored at DT_INIT_FLOOR)."""
    dt = torch.exp(torch.rand_like(tensor) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
    dt = dt.clamp(min=DT_INIT_FLOOR)
    tensor.copy_(dt + torch.log(-torch.expm1(-dt)))


class DepthwiseConvWeights(nn.Module):
    """The causal depthwise convolution's `weight` [channels, 1, kernel] and `bias` [channels] (nn.Conv1d's
    names), set by the mixer: built without nn.Conv1d's own random init, which would draw another number of
    values at every TP size."""

    weight: nn.Parameter
    bias: nn.Parameter


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * SiLU(z) over each group of channels (`width` channels in `groups` groups, whole), in fp32
    (mamba-ssm's RMSNormGated with norm_before_gate=False); the weight is split over TP with the groups."""

    def __init__(
        self, width: int, groups: int, dtype: torch.dtype, tp_group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.group_width = width // groups
        self.weight = _tp_parameter((width,), nn.init.ones_, dtype, tp_group)

    def forward(self, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: the share of the weight for y's channels (context parallelism); default all of it."""
        weight = self.weight if weight is None else weight
        gated = (y.float() * F.silu(z.float())).unflatten(-1, (-1, self.group_width))
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + GATED_NORM_EPS)
        return (normed.flatten(-2) * weight.float()).to(y.dtype)


class MambaState:
    """One Mamba layer's slots in a generation cache: its conv inputs of the last CONV_KERNEL - 1 positions
    [b, conv channels, 3] and its fp32 SSM state [b, heads, head dim, state dim], both updated in place."""

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        self.conv = conv
        self.ssm = ssm


@functools.cache
def _fused_conv() -> Callable | None:
    """causal-conv1d's kernel when the package is installed (CUDA only)."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    return causal_conv1d_fn


class MambaMixer(nn.Module):
    """Mamba-2's mixer over hidden states [s, b, h] ([s / TP, b, h] under sequence parallelism), this TP rank's
    heads and groups. Weights are drawn whole and sliced, so a TP=N mixer holds the TP=1 mixer's weights. Under
    context parallelism (`cp_group` of two ranks or more) the input is this rank's chunks of the sequence and
    the convolution and scan run over the whole sequence for 1/CP of the heads (`models.mamba_context_parallel`);
    `heads`, `groups`, `d_inner` and `bc` are then the share the scan sees."""

    def __init__(
        self,
        config: TransformerConfig,
        sequence_parallel: bool,
        tp_group: dist.ProcessGroup | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        tp_group = state.tensor_group_or_default(tp_group)
        tp_size, cp_size = state.group_size(tp_group), state.group_size(cp_group)
        check_mamba_config(config, tp_size, cp_size)
        heads, d_inner, bc, conv_channels = mamba_shapes(config)
        self.head_dim, self.state_dim = config.mamba_head_dim, config.mamba_state_dim
        local = (d_inner // tp_size, d_inner // tp_size, bc // tp_size, bc // tp_size, heads // tp_size)
        self.context_parallel = MambaContextParallel(cp_group, local) if cp_size > 1 else None
        self.conv_parts = local[1:4]  # x, B and C of this TP rank
        self.heads, self.groups = heads // tp_size // cp_size, config.mamba_num_groups // tp_size // cp_size
        self.d_inner, self.bc = local[0] // cp_size, local[2] // cp_size
        dtype = config.params_dtype
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            2 * d_inner + 2 * bc + heads,
            init_method=init_method_normal(config.init_method_std),
            bias=False,
            partition_sizes=(d_inner, d_inner, bc, bc, heads),
            sequence_parallel=sequence_parallel,
            params_dtype=dtype,
            tp_group=tp_group,
        )
        conv_parts = [d_inner, bc, bc]
        self.conv1d = DepthwiseConvWeights()
        bound = 1 / math.sqrt(CONV_KERNEL)
        self.conv1d.weight = _tp_parameter(  # nn.Conv1d's init, on the whole weight
            (conv_channels, 1, CONV_KERNEL), lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)), dtype, tp_group,
            conv_parts,
        )  # fmt: skip
        self.conv1d.bias = _tp_parameter(
            (conv_channels,), lambda t: t.uniform_(-bound, bound), dtype, tp_group, conv_parts
        )
        # A = -exp(A_log), A uniform in A_INIT_RANGE
        self.dt_bias = _tp_parameter((heads,), _dt_bias, dtype, tp_group)
        self.A_log = _tp_parameter((heads,), lambda t: t.uniform_(*A_INIT_RANGE).log_(), dtype, tp_group)
        self.D = _tp_parameter((heads,), nn.init.ones_, dtype, tp_group)
        self.norm = GatedRMSNorm(d_inner, config.mamba_num_groups, dtype, tp_group)
        self.out_proj = RowParallelLinear(
            d_inner,
            config.hidden_size,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            bias=False,
            sequence_parallel=sequence_parallel,
            params_dtype=dtype,
            tp_group=tp_group,
        )

    def forward(
        self, hidden: torch.Tensor, cache: MambaState | None = None, seq_idx: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mixer output [s, b, h] (sequence-split as the input). `cache`: the layer's generation state, read as
        the state before the first position and left holding the state after the last. `seq_idx` [b, s]: each
        position's document (--reset-attention-mask): convolution and state restart where it changes; under
        context parallelism the whole sequence's ids, in order."""
        zxbcdt = self.in_proj(hidden).transpose(
            0, 1
        )  # [b, s, parts]: the whole sequence, or this CP rank's chunks
        cp = self.context_parallel
        if cp is not None:
            if cache is not None:
                raise ValueError("generation runs without context parallelism: load the model with CP 1")
            zxbcdt = cp.to_heads(zxbcdt)  # [b, S, parts / CP]: the whole sequence, this CP rank's heads
        z, xbc, dt = zxbcdt.split([self.d_inner, self.d_inner + 2 * self.bc, self.heads], dim=-1)
        A = -torch.exp(self._rank_share(self.A_log).float())
        if cache is not None and xbc.shape[1] == 1:
            y = self._step(xbc[:, 0], dt[:, 0], A, cache)[:, None]
        else:
            xbc = self._convolve(xbc, cache, seq_idx)
            x, B, C = xbc.split([self.d_inner, self.bc, self.bc], dim=-1)
            batch, length = x.shape[:2]
            y = mamba_chunk_scan(
                x.reshape(batch, length, self.heads, self.head_dim),
                dt,
                A,
                B.reshape(batch, length, self.groups, self.state_dim),
                C.reshape(batch, length, self.groups, self.state_dim),
                CHUNK_SIZE,
                D=self._rank_share(self.D),
                dt_bias=self._rank_share(self.dt_bias),
                initial_states=None if cache is None else cache.ssm,
                seq_idx=seq_idx,
                dt_softplus=True,
                return_final_states=cache is not None,
            )
            if cache is not None:
                y, final_state = y
                cache.ssm.copy_(final_state)
            y = y.flatten(-2)
        y = self.norm(y, z, self._rank_share(self.norm.weight))
        if cp is not None:
            y = cp.to_sequence(y)
        return self.out_proj(y.transpose(0, 1))

    def _rank_share(self, param: torch.Tensor, part_sizes: tuple[int, ...] | None = None) -> torch.Tensor:
        """This CP rank's share of a per-head or per-channel parameter (all of it without context parallelism)."""
        cp = self.context_parallel
        return param if cp is None else cp.rank_slice(param, part_sizes)

    def _convolve(
        self, xbc: torch.Tensor, cache: MambaState | None, seq_idx: torch.Tensor | None
    ) -> torch.Tensor:
        """SiLU of the causal depthwise convolution of [b, s, channels], after the cached inputs (zeros at a
        sequence's start); with `seq_idx`, taps in another document than their position count as zeros. Written
        as CONV_KERNEL shifted multiply-adds over the channels (the last, contiguous dim): on CPU torch's
        depthwise conv1d, its backward above all, is several times slower."""
        weight = self._rank_share(self.conv1d.weight, self.conv_parts)
        bias = self._rank_share(self.conv1d.bias, self.conv_parts)
        fused = _fused_conv() if xbc.is_cuda and cache is None else None
        if fused is not None:
            index = None if seq_idx is None else seq_idx.to(torch.int32)
            columns = xbc.transpose(1, 2)
            return fused(columns, weight.squeeze(1), bias, seq_idx=index, activation="silu").transpose(1, 2)
        length = xbc.shape[1]
        if cache is None:
            window = F.pad(xbc, (0, 0, CONV_KERNEL - 1, 0))  # [b, s + 3, channels]
        else:
            window = torch.cat((cache.conv.transpose(1, 2).to(xbc.dtype), xbc), dim=1)
            cache.conv.copy_(window[:, -(CONV_KERNEL - 1) :].transpose(1, 2))
        if seq_idx is not None:
            documents = F.pad(seq_idx, (CONV_KERNEL - 1, 0), value=-1)
        out = bias
        for tap in range(CONV_KERNEL):  # input position t - (CONV_KERNEL - 1) + tap
            inputs = window[:, tap : tap + length]
            if seq_idx is not None:
                inputs = inputs * (documents[:, tap : tap + length] == seq_idx)[..., None].to(inputs.dtype)
            out = out + inputs * weight[:, 0, tap]
        return F.silu(out)

    def _step(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, cache: MambaState) -> torch.Tensor:
        """One new position per row [b, ...] from the cached conv inputs and SSM state (updated in place)."""
        window = torch.cat((cache.conv.to(xbc.dtype), xbc[..., None]), dim=-1)  # [b, channels, kernel]
        cache.conv.copy_(window[..., 1:])
        xbc = F.silu((window * self.conv1d.weight[:, 0]).sum(-1) + self.conv1d.bias)
        x, B, C = xbc.split([self.d_inner, self.bc, self.bc], dim=-1)
        batch = x.shape[0]
        y = ssd_step(
            cache.ssm,
            x.reshape(batch, self.heads, self.head_dim),
            discretize(dt, self.dt_bias, dt_softplus=True),
            A,
            B.reshape(batch, self.groups, self.state_dim),
            C.reshape(batch, self.groups, self.state_dim),
            self.D,
        )
        return y.flatten(-2)

    def new_state(self, batch_size: int, device: torch.device | str) -> MambaState:
        """An empty generation state for `batch_size` rows (zeros: the state before any token)."""
        dtype = self.conv1d.weight.dtype
        conv = torch.zeros(
            batch_size, self.d_inner + 2 * self.bc, CONV_KERNEL - 1, dtype=dtype, device=device
        )
        ssm = torch.zeros(batch_size, self.heads, self.head_dim, self.state_dim, device=device)
        return MambaState(conv, ssm)


class MambaLayer(nn.Module):
    """x + dropout(mixer(norm(x))). The layers of a hybrid model take the groups they are split over
    (`pg_collection`: TP, and CP for the mixer and attention)."""

    def __init__(
        self, config: TransformerConfig, sequence_parallel: bool, pg_collection: state.ProcessGroupCollection
    ) -> None:
        super().__init__()
        self.norm = build_norm(config, sequence_parallel)
        self.mixer = MambaMixer(config, sequence_parallel, pg_collection.tp, pg_collection.cp)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        self.slot = 0  # the layer's slot among its stage's Mamba layers in a generation cache

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Rotary,
        cache: HybridCache | None,
        attention_mask: torch.Tensor | None,
        seq_idx: torch.Tensor | None,
    ) -> torch.Tensor:
        state_slot = None if cache is None else cache.mamba_states[self.slot]
        return hidden + self.hidden_dropout(self.mixer(self.norm(hidden), state_slot, seq_idx))


class AttentionLayer(nn.Module):
    """x + dropout(attention(input_layernorm(x))): a transformer layer's first half (Megatron's `*`)."""

    def __init__(
        self, config: TransformerConfig, sequence_parallel: bool, pg_collection: state.ProcessGroupCollection
    ) -> None:
        super().__init__()
        self.input_layernorm = build_norm(config, sequence_parallel)
        self.self_attention = SelfAttention(config, 0, sequence_parallel, pg_collection.tp, pg_collection.cp)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    @property
    def slot(self) -> int:
        return self.self_attention.layer_index

    @slot.setter
    def slot(self, index: int) -> None:  # the layer's slot among its stage's attention layers in a KV cache
        self.self_attention.layer_index = index

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Rotary,
        cache: HybridCache | None,
        attention_mask: torch.Tensor | None,
        seq_idx: torch.Tensor | None,
    ) -> torch.Tensor:
        attention = self.self_attention(self.input_layernorm(hidden), rotary, cache, attention_mask)
        return hidden + self.hidden_dropout(attention)


class MLPLayer(nn.Module):
    """x + dropout(mlp(pre_mlp_layernorm(x))): a transformer layer's second half (Megatron's `-`); with `mlp` an
    MoE layer (`models.moe.layer.MoELayer`), Megatron's `E` (default: a dense MLP of --ffn-hidden-size)."""

    def __init__(
        self,
        config: TransformerConfig,
        sequence_parallel: bool,
        pg_collection: state.ProcessGroupCollection,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.pre_mlp_layernorm = build_norm(config, sequence_parallel)
        self.mlp = MLP(config, sequence_parallel, pg_collection.tp) if mlp is None else mlp
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Rotary,
        cache: HybridCache | None,
        attention_mask: torch.Tensor | None,
        seq_idx: torch.Tensor | None,
    ) -> torch.Tensor:
        return hidden + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(hidden)))


class HybridCache(KVCache):
    """What generation keeps of a hybrid stage's past: keys and values of its attention layers (the KV cache's
    slots, one per attention layer: `KVCache`'s arguments) and the conv and SSM state of each Mamba layer;
    `reorder` follows beam search."""

    def __init__(self, mamba_states: list[MambaState], **kv_cache: object) -> None:
        super().__init__(**kv_cache)
        self.mamba_states = mamba_states

    def reorder(self, order: torch.Tensor) -> None:
        super().reorder(order)
        for slot in self.mamba_states:
            slot.conv.copy_(slot.conv[order])
            slot.ssm.copy_(slot.ssm[order])
