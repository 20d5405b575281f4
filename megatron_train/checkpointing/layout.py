"""Pure resharding rules for checkpoints: TP shards <-> global tensors, layer numbers across PP stages, vocab padding.

A checkpoint stores every tensor under its global name (`decoder.layers.<global index>.`) together with how it
is split over tensor parallelism (Megatron's `partition_dim` and `partition_stride`). Any (TP, PP) layout can
then take its part: merge the saved TP shards into the global tensor, resize the padded vocabulary if the new
TP size pads it differently, and cut the new TP rank's slice. No files and no process groups here.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_train.models.config import TransformerConfig
from megatron_train.parallel.layers import merge_rank_slices, slice_for_rank

if TYPE_CHECKING:  # the families import the checkpointing package; the type alone is needed here
    from megatron_train.families.family import PipelineSplit

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "output_layer.weight"
# Params whose first dim is the padded vocabulary (split across TP along it); BERT's output layer has a bias.
VOCAB_PARAMS = (WORD_EMBEDDING, OUTPUT_WEIGHT, "output_layer.bias")
# GPT's layer stack is `decoder`, BERT's `encoder`, T5 has both (Megatron-Core's names).
_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorSharding:
    """How one param is laid out across TP ranks: `partition_dim` -1 means replicated on every rank.

    With stride s the global dim is cut into TP * s equal chunks and TP rank r holds chunks r, r + TP, ...
    (a SwiGLU fc1 [gate; up] has s = 2, so each rank holds [gate_r; up_r]). `partition_sizes`: the dim packs
    parts of these sizes, each split over TP on its own (Mamba's in-projection [z, x, B, C, dt]).
    """

    partition_dim: int = -1
    partition_stride: int = 1
    partition_sizes: tuple[int, ...] | None = None

    @property
    def is_split(self) -> bool:
        return self.partition_dim >= 0


def sharding_of(record: dict) -> TensorSharding:
    """The TP split a checkpoint's record of a tensor gives (records before `partition_sizes` have none)."""
    sizes = record.get("partition_sizes")
    return TensorSharding(
        record["partition_dim"], record["partition_stride"], None if sizes is None else tuple(sizes)
    )


def param_sharding(param: torch.Tensor | None) -> TensorSharding:
    """The TP split of a model's param, from Megatron's attributes (none: replicated)."""
    if not getattr(param, "tensor_model_parallel", False):
        return TensorSharding()
    sizes = getattr(param, "partition_sizes", None)
    return TensorSharding(int(param.partition_dim), int(getattr(param, "partition_stride", 1)), sizes)


@dataclass(frozen=True)
class ExpertLayout:
    """How MoE experts are split: over `ep_size` expert-parallel ranks along their first axis (the experts), each
    expert over `etp_size` expert-tensor-parallel ranks as its `TensorSharding` says; this rank's place."""

    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0


def merge_expert_shards(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The experts of every EP rank, in EP rank order (their ETP shards already merged): all the layer's experts."""
    return shards[0] if len(shards) == 1 else torch.cat(list(shards))


def split_expert_shard(
    tensor: torch.Tensor, ep_size: int, ep_rank: int, name: str = "tensor"
) -> torch.Tensor:
    """EP rank `ep_rank`'s experts of a tensor holding all of a layer's experts on its first axis."""
    if tensor.shape[0] % ep_size:
        raise ValueError(
            f"{name}: {tensor.shape[0]} experts cannot be split over {ep_size} expert-parallel ranks; pick an "
            "--expert-model-parallel-size that divides --num-experts"
        )
    return tensor.chunk(ep_size)[ep_rank].contiguous()


def split_expert_tensor(
    tensor: torch.Tensor, sharding: TensorSharding, layout: ExpertLayout, name: str = "tensor"
) -> torch.Tensor:
    """The part of a layer's all-experts tensor `layout` says this rank holds: its EP rank's experts, cut over
    expert TP as `sharding` says."""
    mine = split_expert_shard(tensor, layout.ep_size, layout.ep_rank, name)
    return split_tp_shard(mine, sharding, layout.etp_size, layout.etp_rank, name)


def merge_tp_shards(shards: Sequence[torch.Tensor], sharding: TensorSharding) -> torch.Tensor:
    """The global tensor from its TP shards, in TP rank order (inverse of `split_tp_shard`)."""
    if not sharding.is_split or len(shards) == 1:
        return shards[0]
    return merge_rank_slices(
        shards, sharding.partition_dim, sharding.partition_stride, sharding.partition_sizes
    )


def split_tp_shard(
    tensor: torch.Tensor, sharding: TensorSharding, tp_size: int, tp_rank: int, name: str = "tensor"
) -> torch.Tensor:
    """TP rank `tp_rank`'s slice of a global tensor (the same cut `parallel_weight` makes at init)."""
    if not sharding.is_split or tp_size == 1:
        return tensor
    dim = sharding.partition_dim
    return slice_for_rank(
        tensor,
        dim,
        tp_size,
        tp_rank,
        sharding.partition_stride,
        sharding.partition_sizes,
        f"{name} dim {dim}",
    )


def resize_vocab(tensor: torch.Tensor, padded_vocab_size: int, replicate_last_row: bool) -> torch.Tensor:
    """Cut or extend the padding rows of a [padded vocab, ...] tensor.

    Extra rows copy the last row for weights (Megatron's checkpoint converter does the same) or are zeros
    (Adam moments: a fresh state). Rows beyond the true vocabulary are padding, so cutting them loses nothing
    as long as the new size still holds the true vocabulary.
    """
    rows = tensor.shape[0]
    if rows >= padded_vocab_size:
        return tensor[:padded_vocab_size]
    extra = padded_vocab_size - rows
    fill = (
        tensor[-1:].expand(extra, *tensor.shape[1:])
        if replicate_last_row
        else tensor.new_zeros(extra, *tensor.shape[1:])
    )
    return torch.cat((tensor, fill))


def true_vocab_range(padded: int, multiple: int) -> tuple[int, int]:
    """The true vocabulary sizes V with `padded` = V rounded up to `multiple`: low < V <= high."""
    return padded - multiple, padded


def padded_vocab_sizes_agree(saved: tuple[int, int], ours: tuple[int, int]) -> bool:
    """Whether one true vocabulary size explains the saved and our padded sizes (each as `true_vocab_range`):
    a TP change may re-pad the vocabulary, a different tokenizer may not."""
    return max(saved[0], ours[0]) < min(saved[1], ours[1])


def layer_number(name: str) -> int | None:
    """The layer index in `decoder.layers.<i>.` (or `encoder.`), None for params outside the layer stack."""
    match = _LAYER.match(name)
    return int(match.group(2)) if match else None


def renumber_layer(name: str, offset: int) -> str:
    """`decoder.layers.<i>.x` -> `decoder.layers.<i + offset>.x` (local <-> global); other names unchanged."""
    index = layer_number(name)
    if index is None or offset == 0:
        return name
    return _LAYER.sub(rf"\g<1>.layers.{index + offset}.", name, count=1)


def global_param_name(local_name: str, layer_offset: int, holds_tied_output_copy: bool) -> str:
    """The checkpoint name of a param of one pipeline stage.

    The last stage's copy of a tied output layer (PP > 1) is the word embedding, which the first stage owns;
    the pipeline engine keeps both copies equal, so the checkpoint stores it once, as the embedding.
    """
    if holds_tied_output_copy and local_name == OUTPUT_WEIGHT:
        return WORD_EMBEDDING
    return renumber_layer(local_name, layer_offset)


def module_order(name: str) -> tuple[int, int]:
    """Sort key putting checkpoint names in a GPT model's module order: embedding, layers by global index, the
    rest (final norm, output layer). Sorting is stable, so names within one layer keep their order."""
    index = layer_number(name)
    if index is not None:
        return 1, index
    return (0, 0) if name.startswith("embedding.") else (2, 0)


def stage_tensor_names(
    split: PipelineSplit,
    global_names: Sequence[str],
    layers: Collection[int],
    pre_process: bool,
    post_process: bool,
) -> list[str]:
    """The checkpoint names one pipeline stage's shard holds, cut by its family's `split`: those of its `layers`
    (with virtual stages, all its chunks'), the embedding's on the first stage (`pre_process`), the output end's on
    the last, in the order of `global_names` (a whole model's, in module order)."""
    names = []
    for name in global_names:
        index = layer_number(name)
        if index is not None:
            owned = index in layers
        elif name.startswith(split.first_stage_prefixes):
            owned = pre_process
        elif name.startswith(split.last_stage_prefixes):
            owned = post_process
        else:
            raise ValueError(f"checkpoint tensor {name!r} belongs to no pipeline stage of this model family")
        if owned:
            names.append(name)
    return names


def check_layout(
    model: TransformerConfig,
    split: PipelineSplit,
    padded_vocab_size: int,
    tp_size: int,
    pp_size: int,
    layers_per_virtual_stage: int | None = None,
) -> None:
    """Refuse a (TP, PP, virtual) layout the model cannot be cut into, naming the setting that does not fit; the
    pipeline stages are cut as the model's family cuts them (`split`)."""
    splits = (
        ("--num-attention-heads", model.num_attention_heads, tp_size, "tensor"),
        ("number of query groups (--num-query-groups)", model.num_query_groups_effective, tp_size, "tensor"),
        ("--ffn-hidden-size", model.ffn_hidden_size, tp_size, "tensor"),
        ("padded vocabulary size", padded_vocab_size, tp_size, "tensor"),
    )
    if pp_size < 1:
        raise ValueError(f"the target pipeline model parallel size must be at least 1, got {pp_size}")
    for what, size, parts, kind in splits:
        if parts < 1 or size % parts:
            raise ValueError(
                f"{what} ({size}) is not divisible by the target {kind} model parallel size ({parts}); "
                f"pick a {kind} model parallel size that divides it"
            )
    for pp_rank in range(pp_size):
        try:
            split.layer_range(model, pp_rank, pp_size, 0, None)
        except ValueError as error:
            raise ValueError(
                f"the target pipeline model parallel size ({pp_size}) does not cut this model: {error}"
            ) from None
    if layers_per_virtual_stage is None:
        return
    if pp_size == 1:
        raise ValueError("virtual pipeline stages need a target pipeline model parallel size > 1")
    layers_per_stage = model.num_layers // pp_size
    if layers_per_virtual_stage < 1 or layers_per_stage % layers_per_virtual_stage:
        raise ValueError(
            f"each of the {pp_size} pipeline stages holds {layers_per_stage} of --num-layers "
            f"({model.num_layers}), which does not split into virtual stages of {layers_per_virtual_stage} "
            "layers; pick a number of layers per virtual pipeline stage that divides it"
        )
