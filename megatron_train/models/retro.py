"""RetroModel: a GPT decoder whose layers 6, 9, 12, ... attend to retrieved neighbours by chunked cross-attention.

Megatron-Core's Retro (megatron/core/models/retro): the decoder is our GPT (`GPTModel`, `TransformerBlock`);
layer numbers `retro_decoder_layer_numbers` (1-based: from 6 when the decoder has at most 15 layers, else 9,
every 3rd) get a `RetroDecoderCrossAttention` between self-attention and MLP, and the first of them owns the
bidirectional Retro encoder (`--retro-encoder-layers`), whose first layer cross-attends from each neighbour to
the decoder's hidden states of the chunk it was retrieved for. The first Retro layer hands the encoded
neighbours on as the context of the later ones (`TransformerLayer` returns (hidden, context)).

Shapes (Megatron's notation): ns tokens, b samples, l = ceil(ns / m) chunks of m tokens, k neighbours per chunk,
r = num_retrieved_chunks x m tokens per neighbour (the neighbour chunk and its continuation), B = b * l.
`neighbor_tokens` [b, l, k, r] are embedded with the decoder's embedding into the context [r, B * k, h].

Chunked cross-attention (CCA): chunk j's neighbours are attended to by the tokens from the last token of chunk
j to the one before the last token of chunk j + 1, so no token sees neighbours retrieved with its own future:
the hidden states are shifted by pad = (ns - 1) % m, padded with m - 1 zeros, cut into l chunks [m, B, h] and
cross-attend to their neighbours [r * k, B, h]; the output goes back to [ns, b, h] with the first pad positions
zero, and the layer adds it to the residual stream after dropout (Megatron's RetroDecoderBiasDropoutAdd).

Generation with a KV cache (`RetroKVCache`, `forward(..., kv_cache=...)`): the chunks are the training chunks,
cut from the first token, so once chunk j is complete (its last token is in) nothing before its end changes.
Each step feeds the new tokens and the neighbours of the chunks they complete; self-attention keeps every
layer's keys and values, the first Retro layer keeps its (normalised) states of the chunk being written and,
when a chunk completes, encodes that chunk's neighbours once, and every Retro layer attends from each new
position to the encoded neighbours of the last chunk completed at or before it (none before chunk 0's last
token), the same attention as the chunked one over the whole text.

Parallelism: tensor parallel as every attention (`CrossAttention`). Under sequence parallelism the layer
gathers its [ns / TP] shard, rearranges the whole sequence into chunks and runs the chunk-major tensors
sequence parallel again (split along the chunk's m positions, the neighbours' r positions), so dropout draws
from the per-rank stream on sharded tensors only; m and r must divide by TP. Pipeline parallelism is refused,
as Megatron did (the encoder sits inside a decoder layer). See docs/architecture.md (Retro model).

Deviations from Megatron-Core: the encoder's first layer adds its cross-attention to the un-normalised
neighbour states (the pre-norm residual of every other layer and of Megatron's legacy Retro; Megatron-Core adds
it to the normalised ones); RoPE models rotate the encoder's queries and keys by neighbour position (Megatron-Core
passes the encoder no rotary embedding); the encoder's output projections are initialised for its own depth.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.cross_attention import CrossAttention
from megatron_train.models.gpt import GPTModel
from megatron_train.models.kv_cache import KVCache
from megatron_train.models.retro_config import RetroConfig
from megatron_train.models.rotary import RotaryEmbedding
from megatron_train.models.transformer import TransformerBlock
from megatron_train.parallel import state
from megatron_train.parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_train.parallel.state import ProcessGroupCollection


class RetroKVCache(KVCache):
    """The decoder's keys and values, and what Retro's layers carry from one generation step to the next: the
    tokens so far [b, offset] (whose completed chunks a retriever reads), the encoded neighbours of every
    completed chunk (chunk j -> [r * k, b, h]) and the first Retro layer's states of the chunk being written."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tokens: torch.Tensor | None = None
        self.contexts: list[torch.Tensor] = []
        self.chunk_states: torch.Tensor | None = None

    def reset(self) -> None:
        super().reset()
        self.tokens, self.chunk_states = None, None
        self.contexts.clear()


@dataclasses.dataclass
class RetroStep:
    """One cached generation step, handed to the Retro layers as their context: the cache, and per chunk that
    the new tokens complete (in order) its neighbours embedded [r, b * k, h]."""

    cache: RetroKVCache
    new_chunks: list[int]
    neighbours: list[torch.Tensor]


def completed_chunks(offset: int, new_tokens: int, chunk_length: int) -> list[int]:
    """The chunks whose last token is among positions offset .. offset + new_tokens - 1."""
    return list(range(offset // chunk_length, (offset + new_tokens) // chunk_length))


def retro_decoder_layer_numbers(num_layers: int) -> list[int]:
    """The 1-based decoder layers with chunked cross-attention (Megatron's `get_retro_decoder_block_spec`)."""
    start = 6 if num_layers <= 15 else 9
    numbers = list(range(start, num_layers + 1, 3))
    if not numbers:
        raise ValueError(
            f"--num-layers {num_layers}: Retro's first chunked cross-attention layer is layer {start}; "
            "give the decoder at least 6 layers"
        )
    return numbers


def to_chunks(hidden: torch.Tensor, chunk_length: int) -> torch.Tensor:
    """[l * m, b, h] -> [m, b * l, h]: position within the chunk first, then (sample, chunk)."""
    seq, batch, width = hidden.shape
    chunks = seq // chunk_length
    return (
        hidden.reshape(chunks, chunk_length, batch, width)
        .permute(1, 2, 0, 3)
        .reshape(chunk_length, batch * chunks, width)
    )


def from_chunks(chunked: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of `to_chunks`: [m, b * l, h] -> [l * m, b, h]."""
    chunk_length, samples_times_chunks, width = chunked.shape
    chunks = samples_times_chunks // batch
    return (
        chunked.reshape(chunk_length, batch, chunks, width)
        .permute(2, 0, 1, 3)
        .reshape(chunks * chunk_length, batch, width)
    )


def _split_sequence(
    x: torch.Tensor, sequence_parallel: bool, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    return scatter_to_sequence_parallel_region(x, tp_group) if sequence_parallel else x


def _whole_sequence(
    x: torch.Tensor, sequence_parallel: bool, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The whole tensor from its sequence-parallel shards; the gradient of the (replicated) result is split."""
    if not sequence_parallel:
        return x
    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=tp_group)


class RetroEncoderCrossAttention(nn.Module):
    """The encoder's first-layer cross-attention: each neighbour of chunk c (queries) attends to the decoder's
    hidden states of chunk c (keys, values); Megatron's RetroEncoderCrossAttention run for all k at once."""

    def __init__(
        self,
        config: TransformerConfig,
        num_neighbors: int,
        sequence_parallel: bool,
        tp_group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__()
        self.num_neighbors = num_neighbors
        self.attn = CrossAttention(config, sequence_parallel, tp_group)

    def forward(
        self, hidden: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [r, B * k, h] (neighbours, k fastest), context [m, B, h] (decoder chunks); / TP along the
        first dimension under SP. Returns [r, B * k, h]."""
        m, chunks, width = context.shape
        per_neighbour = context.unsqueeze(2).expand(m, chunks, self.num_neighbors, width)
        return self.attn(hidden, per_neighbour.reshape(m, chunks * self.num_neighbors, width), context_mask)


def build_retro_encoder(
    config: TransformerConfig,
    retro: RetroConfig,
    sequence_parallel: bool,
    pg_collection: ProcessGroupCollection,
) -> TransformerBlock:
    """Megatron's Retro encoder: `--retro-encoder-layers` bidirectional layers with the encoder's dropouts, the
    first with `RetroEncoderCrossAttention`, no final norm."""
    encoder_config = dataclasses.replace(
        config,
        num_layers=retro.retro_encoder_layers,
        hidden_dropout=retro.retro_encoder_hidden_dropout,
        attention_dropout=retro.retro_encoder_attention_dropout,
        use_flash_attn=False,  # bidirectional attention runs on scaled_dot_product_attention
    )
    return TransformerBlock(
        encoder_config,
        sequence_parallel,
        post_process=False,
        cross_attention_for=lambda layer: (
            RetroEncoderCrossAttention(
                encoder_config, retro.retro_num_neighbors, sequence_parallel, pg_collection.tp
            )
            if layer == 0
            else None
        ),
        pg_collection=pg_collection,
    )


class RetroDecoderCrossAttention(nn.Module):
    """Chunked cross-attention of one Retro decoder layer (Megatron's RetroDecoderCrossAttention and the
    reshaping of its RetroDecoderBiasDropoutAdd); the first one runs the encoder (`encoder` not None)."""

    def __init__(
        self,
        config: TransformerConfig,
        retro: RetroConfig,
        sequence_parallel: bool,
        tp_group: dist.ProcessGroup | None,
        encoder: TransformerBlock | None = None,
    ) -> None:
        super().__init__()
        self.chunk_length = retro.retro_chunk_length
        self.num_neighbors = retro.retro_num_neighbors
        self.retrieved_length = retro.retro_retrieved_length
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group
        self.attn = CrossAttention(config, sequence_parallel, tp_group)
        self.encoder = encoder
        self.encoder_rotary = None
        if encoder is not None and config.position_embedding_type == "rope":
            self.encoder_rotary = RotaryEmbedding(
                config.kv_channels,
                config.rotary_percent,
                config.rotary_base,
                config.rope_scaling_factor if config.use_rope_scaling else None,
            )

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor | RetroStep,
        context_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | RetroStep]:
        """hidden [ns, b, h] (normalised); context: the embedded neighbours [r, B * k, h] for the layer with
        the encoder, else the encoded ones [r * k, B, h] (first dimensions / TP under SP); or a cached
        generation step (`RetroStep`, hidden then the new positions only). Returns the output [ns, b, h] and
        the context of the following Retro layers (the encoded neighbours, or the same step)."""
        if isinstance(context, RetroStep):
            return self._forward_cached(hidden, context), context
        sp, group, m = self.sequence_parallel, self.tp_group, self.chunk_length
        hidden = _whole_sequence(hidden, sp, group)
        ns, batch, _ = hidden.shape
        if self.encoder is not None:
            context = self._encode(hidden, context)
        pad = (ns - 1) % m
        shifted = F.pad(hidden[pad:], (0, 0, 0, 0, 0, m - 1))  # chunk j starts at chunk j's last token
        output = self.attn(_split_sequence(to_chunks(shifted, m), sp, group), context)  # [m, B, h]
        output = from_chunks(_whole_sequence(output, sp, group), batch)
        output = F.pad(output, (0, 0, 0, 0, pad, 0))[:ns]
        return _split_sequence(output, sp, group), context

    def _forward_cached(self, hidden: torch.Tensor, step: RetroStep) -> torch.Tensor:
        """The output [s, b, h] at the new positions offset .. offset + s - 1 (`hidden` [s, b, h]): the layer with
        the encoder first encodes the neighbours of the chunks these positions complete."""
        if self.sequence_parallel:
            raise ValueError("Retro generation with a KV cache runs without --sequence-parallel")
        m, cache = self.chunk_length, step.cache
        offset, new = cache.seq_len_offset, hidden.shape[0]
        if self.encoder is not None:
            states = hidden if cache.chunk_states is None else torch.cat((cache.chunk_states, hidden))
            first = offset - len(states) + new  # the position of states[0]: the start of the open chunk
            for chunk, neighbours in zip(step.new_chunks, step.neighbours, strict=True):
                cache.contexts.append(
                    self._encode(states[chunk * m - first : (chunk + 1) * m - first], neighbours)
                )
            cache.chunk_states = states[(offset + new) // m * m - first :]
        output = torch.zeros_like(hidden)
        for chunk in range(max(offset + 1, m) // m - 1, (offset + new) // m):
            start, end = max(offset, chunk * m + m - 1), min(offset + new, chunk * m + 2 * m - 1)
            output[start - offset : end - offset] = self.attn(
                hidden[start - offset : end - offset], cache.contexts[chunk]
            )
        return output

    def _encode(self, hidden: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
        """The encoder over the embedded neighbours, conditioned on each chunk's decoder states; returns
        [r * k, B, h] (neighbour-major, as the decoder's keys and values)."""
        m = self.chunk_length
        first = hidden.shape[0] % m  # a sequence of part chunks (generation): the first chunk is padded
        if first:
            hidden = torch.cat((F.pad(hidden[:first], (0, 0, 0, 0, 0, m - first)), hidden[first:]))
        chunks = _split_sequence(to_chunks(hidden, m), self.sequence_parallel, self.tp_group)
        rotary = None
        if self.encoder_rotary is not None:
            positions = torch.arange(self.retrieved_length, device=hidden.device).unsqueeze(0)
            rotary = self.encoder_rotary(positions)
        bidirectional = torch.ones(1, 1, 1, self.retrieved_length, dtype=torch.bool, device=hidden.device)
        encoded = self.encoder(neighbours, rotary, attention_mask=bidirectional, context=chunks)
        r_local, chunks_times_k, width = encoded.shape
        encoded = encoded.reshape(r_local, chunks_times_k // self.num_neighbors, self.num_neighbors, width)
        return encoded.transpose(1, 2).reshape(r_local * self.num_neighbors, -1, width)


class RetroModel(GPTModel):
    """GPT decoder with chunked cross-attention to retrieved neighbours (Megatron-Core's RetroModel).

    forward(input_ids [b, ns], position_ids, labels, neighbor_tokens [b, l, k, r]) as `GPTModel.forward`, the
    neighbours embedded by the decoder's embedding at positions 0 .. r - 1. With a `RetroKVCache` (generation,
    which Megatron ran without a cache), input_ids are the new tokens and neighbor_tokens [b, c, k, r] the
    neighbours of the c chunks they complete (`completed_chunks`). `document_ids` cut the decoder's
    self-attention at document ends (the chunked cross-attention, as Megatron's, is not cut). The arguments are
    GPTModel's and the `retro` settings; with `retro.retro_fit_freeze_decoder` only the Retro parameters
    (`is_retro_parameter`) train.
    """

    kv_cache_class = RetroKVCache  # what generation allocates for this model

    model_type = "retro"  # recorded in checkpoints

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        pre_process: bool = True,
        post_process: bool = True,
        *,
        retro: RetroConfig,
        sequence_parallel: bool = False,
        init_seed: int | None = None,
        vp_stage: int = 0,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        pg_collection = pg_collection or state.process_groups()
        if not (pre_process and post_process) or state.group_size(pg_collection.pp) > 1:
            raise ValueError(
                "Retro does not support pipeline parallelism (its encoder runs inside a decoder layer, as in "
                "Megatron): use --pipeline-model-parallel-size 1"
            )
        if retro.retro_chunk_length is None:
            raise ValueError("RetroModel needs retro_chunk_length (pretrain_retro takes it from the project)")
        if config.position_embedding_type == "learned_absolute" and config.max_position_embeddings < (
            retro.retro_retrieved_length
        ):
            raise ValueError(
                f"--max-position-embeddings {config.max_position_embeddings} is shorter than a retrieved "
                f"neighbour ({retro.retro_retrieved_length} tokens: --retro-num-retrieved-chunks x chunk length)"
            )
        if sequence_parallel:
            _check_sequence_parallel_sizes(retro, state.group_size(pg_collection.tp))
        numbers = retro_decoder_layer_numbers(config.num_layers)

        def cross_attention_for(layer: int) -> nn.Module | None:
            if layer + 1 not in numbers:
                return None
            encoder = (
                build_retro_encoder(config, retro, sequence_parallel, pg_collection)
                if layer + 1 == numbers[0]
                else None
            )
            return RetroDecoderCrossAttention(config, retro, sequence_parallel, pg_collection.tp, encoder)

        super().__init__(
            config,
            vocab_size,
            pre_process,
            post_process,
            sequence_parallel=sequence_parallel,
            init_seed=init_seed,
            vp_stage=vp_stage,
            cross_attention_for=cross_attention_for,
            pg_collection=pg_collection,
        )
        self.retro = retro
        if retro.retro_fit_freeze_decoder:
            for name, param in self.named_parameters():
                param.requires_grad = is_retro_parameter(name)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        neighbor_tokens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq = input_ids.shape
        m, k, r = (
            self.retro.retro_chunk_length,
            self.retro.retro_num_neighbors,
            self.retro.retro_retrieved_length,
        )
        if kv_cache is not None and not isinstance(kv_cache, RetroKVCache):
            raise ValueError("a Retro model generates with a RetroKVCache (its kv_cache_class)")
        new_chunks = [] if kv_cache is None else completed_chunks(kv_cache.seq_len_offset, seq, m)
        expected = (batch, math.ceil(seq / m) if kv_cache is None else len(new_chunks), k, r)
        if neighbor_tokens is None or tuple(neighbor_tokens.shape) != expected:
            got = None if neighbor_tokens is None else tuple(neighbor_tokens.shape)
            raise ValueError(
                f"neighbor_tokens must be [batch, chunks, --retro-num-neighbors, retrieved tokens] = {expected} "
                f"for input_ids {tuple(input_ids.shape)}"
                + (
                    ""
                    if kv_cache is None
                    else f" at position {kv_cache.seq_len_offset} (the chunks completed)"
                )
                + f", got {got}"
            )
        retrieved = neighbor_tokens.reshape(-1, r)
        positions = torch.arange(r, device=retrieved.device).expand_as(retrieved)
        context = self.embedding(retrieved, positions) if len(retrieved) else None  # [r, b * l * k, h]
        if kv_cache is not None:
            width = self.config.hidden_size
            per_chunk = (
                [] if context is None else context.reshape(r, batch, len(new_chunks), k, width).unbind(2)
            )
            context = RetroStep(
                kv_cache, new_chunks, [chunk.reshape(r, batch * k, width) for chunk in per_chunk]
            )
        return super().forward(
            input_ids, position_ids, labels, kv_cache=kv_cache, context=context, document_ids=document_ids
        )


def is_retro_parameter(name: str) -> bool:
    """Whether a RetroModel parameter (or state-dict) name belongs to the Retro additions: the chunked
    cross-attention of the Retro layers (with the encoder inside it) and their pre-cross-attention norms."""
    return ".cross_attention." in name or ".pre_cross_attn_layernorm." in name


def _check_sequence_parallel_sizes(retro: RetroConfig, tp: int) -> None:
    for what, size in (
        ("the chunk length", retro.retro_chunk_length),
        ("the retrieved length (--retro-num-retrieved-chunks x chunk length)", retro.retro_retrieved_length),
    ):
        if size % tp:
            raise ValueError(
                f"--sequence-parallel splits Retro's chunks along {what} ({size}), which is not divisible by "
                f"--tensor-model-parallel-size {tp}; drop --sequence-parallel or change the size"
            )
