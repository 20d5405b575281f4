"""MambaModel: a pure Mamba or hybrid Mamba-Transformer language model (Megatron-Core's MambaModel / HybridModel).

Embedding -> the layers `--hybrid-layer-pattern` lists (`models.mamba`: `M` Mamba, `*` attention, `-` MLP, `E` an
MLP layer whose MLP is the MoE layer of `models.moe`, its experts split over expert parallelism) ->
final norm -> output layer, on the shared language-model pieces. Pipeline stages are the pattern's `|` segments
(`hybrid_layer_range`). Generation keeps a `HybridCache` (conv and SSM state per Mamba layer, keys and values per
attention layer) that the model allocates for its own stage (`allocate_inference_cache`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.hybrid_pattern import (
    ATTENTION,
    MAMBA,
    MLP,
    MOE,
    PIPE,
    layer_symbols,
    pipeline_segments,
    segment_range,
)
from megatron_train.models.language_module import LanguageModelEmbedding, LanguageModule, build_output_layer
from megatron_train.models.mamba import AttentionLayer, HybridCache, MambaLayer, MLPLayer
from megatron_train.models.moe.layer import MoELayer
from megatron_train.models.norms import build_norm
from megatron_train.models.rotary import RotaryEmbedding
from megatron_train.models.transformer import FIRST_LAYER_INIT_STREAM, Rotary
from megatron_train.parallel import state
from megatron_train.parallel.random import checkpoint, get_rng_tracker, initialization_stream

LAYER_CLASSES = {MAMBA: MambaLayer, ATTENTION: AttentionLayer, MLP: MLPLayer}


def build_hybrid_layer(
    symbol: str,
    config: TransformerConfig,
    sequence_parallel: bool,
    pg_collection: state.ProcessGroupCollection,
    layer_number: int,
) -> nn.Module:
    """The pattern's layer `symbol` at global layer `layer_number`: an `E` layer is Megatron-Core's hybrid MoE
    layer, the pre-MLP norm and an MoE layer (`mlp.router`, `mlp.experts`) over the run's expert groups."""
    if symbol == MOE:
        moe = MoELayer(config, layer_number, sequence_parallel, pg_collection)
        return MLPLayer(config, sequence_parallel, pg_collection, moe)
    return LAYER_CLASSES[symbol](config, sequence_parallel, pg_collection)


def hybrid_layer_range(
    config: TransformerConfig, pp_rank: int, pp_size: int, vp_rank: int = 0, vp_size: int | None = None
) -> range:
    """The global layers of pipeline stage `pp_rank`: the pattern's segment `pp_rank` (one segment per stage,
    cut by `|`); one stage holds every layer. A pattern without as many segments as stages is refused."""
    pattern = config.hybrid_layer_pattern
    if pp_size == 1:
        return range(config.num_layers)
    segments = pipeline_segments(pattern, config.num_layers)
    if len(segments) != pp_size or vp_size not in (None, 1):
        raise ValueError(
            f"--pipeline-model-parallel-size {pp_size}: a hybrid model's stages are the segments of "
            f"--hybrid-layer-pattern {pattern!r} cut by {PIPE!r}, which has {len(segments)}; cut it into "
            f"{pp_size} segments (as Megatron's pretrain_hybrid)"
        )
    return segment_range(pattern, config.num_layers, pp_rank)


class HybridStack(nn.Module):
    """This pipeline stage's layers of the pattern, the final norm on the last stage, and full-layer recompute.
    `pg_collection`: the groups the layers are split over (the stage's layers from its pipeline group)."""

    def __init__(
        self,
        config: TransformerConfig,
        sequence_parallel: bool,
        post_process: bool,
        init_seed: int | None = None,
        pg_collection: state.ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.sequence_parallel = sequence_parallel
        pg_collection = pg_collection or state.process_groups()
        self.layer_range = hybrid_layer_range(
            config, state.group_rank(pg_collection.pp), state.group_size(pg_collection.pp)
        )
        symbols = layer_symbols(config.hybrid_layer_pattern, config.num_layers)
        layers, slots = [], {MAMBA: 0, ATTENTION: 0}
        for global_index in self.layer_range:
            symbol = symbols[global_index]
            with initialization_stream(init_seed, FIRST_LAYER_INIT_STREAM + global_index):
                layer = build_hybrid_layer(symbol, config, sequence_parallel, pg_collection, global_index)
            if symbol in slots:  # a generation cache's slot among the stage's layers of its kind
                layer.slot = slots[symbol]
                slots[symbol] += 1
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.num_mamba_layers, self.num_attention_layers = slots[MAMBA], slots[ATTENTION]
        self.final_norm = build_norm(config, sequence_parallel) if post_process else None
        self.input_tensor: torch.Tensor | None = None  # from the previous pipeline stage

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: Rotary,
        cache: HybridCache | None,
        attention_mask: torch.Tensor | None,
        seq_idx: torch.Tensor | None,
    ) -> torch.Tensor:
        """`attention_mask` [b, 1, s, s] and `seq_idx` [b, s]: documents of --reset-attention-mask (None:
        one sequence)."""
        rng = get_rng_tracker().fork() if self.sequence_parallel else contextlib.nullcontext()
        with (
            rng
        ):  # sequence-parallel shards differ across TP ranks: their dropout draws from the tracked stream
            config = self.config
            recompute = config.recompute_granularity == "full" and self.training and torch.is_grad_enabled()
            if not recompute or cache is not None:
                hidden = self._run_layers(
                    self.layers, hidden, *(rotary or (None, None)), cache, attention_mask, seq_idx
                )
            else:
                step = config.recompute_num_layers if config.recompute_method == "uniform" else 1
                for start in range(0, len(self.layers), step):
                    layers = self.layers[start : start + step]
                    arguments = (layers, hidden, *(rotary or (None, None)), None, attention_mask, seq_idx)
                    if config.recompute_method == "block" and start >= config.recompute_num_layers:
                        hidden = self._run_layers(*arguments)
                    else:
                        hidden = checkpoint(self._run_layers, *arguments)
        return hidden if self.final_norm is None else self.final_norm(hidden)

    @staticmethod
    def _run_layers(
        layers: nn.ModuleList,
        hidden: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        cache: HybridCache | None,
        attention_mask: torch.Tensor | None,
        seq_idx: torch.Tensor | None,
    ) -> torch.Tensor:
        rotary = None if cos is None else (cos, sin)
        for layer in layers:
            hidden = layer(hidden, rotary, cache, attention_mask, seq_idx)
        return hidden


class MambaModel(LanguageModule):
    """A Mamba or hybrid language model (--hybrid-layer-pattern's layers, else --num-layers Mamba layers):
    `vocab_size` the padded vocabulary, `pre_process` / `post_process`
    whether this stage holds the embedding / the final norm and output layer, `init_seed` (--use-cpu-
    initialization) each part's own stream, `pg_collection` the groups its layers communicate over. `vp_stage` is
    always 0: a hybrid model's stages are its pattern's segments, never split into virtual stages."""

    model_type = "hybrid"  # recorded in checkpoints

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        pre_process: bool = True,
        post_process: bool = True,
        *,
        vp_stage: int = 0,
        sequence_parallel: bool = False,
        init_seed: int | None = None,
        pg_collection: state.ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config, vocab_size, pre_process, post_process, pg_collection=pg_collection)
        if config.position_embedding_type == "relative":
            raise ValueError(
                "--position-embedding-type relative is T5's; a Mamba model takes none, rope or learned"
            )
        tp_group = self.pg_collection.tp
        self.embedding = (
            LanguageModelEmbedding(config, vocab_size, sequence_parallel, init_seed, tp_group=tp_group)
            if pre_process
            else None
        )
        self.mark_first_stage_embedding_copy()
        self.rotary_pos_emb = None
        if config.position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels,
                config.rotary_percent,
                config.rotary_base,
                config.rope_scaling_factor if config.use_rope_scaling else None,
            )
        self.decoder = HybridStack(config, sequence_parallel, post_process, init_seed, self.pg_collection)
        self.output_layer = (
            build_output_layer(
                config, vocab_size, pre_process, sequence_parallel, init_seed, tp_group=tp_group
            )
            if post_process
            else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        kv_cache: HybridCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token fp32 loss [b, s] with labels; else logits [b, s, vocab]; hidden states [s, b, h] off the
        last stage. With a cache (`allocate_inference_cache`) input_ids are the new tokens only and the cache
        holds every layer's state before them. `document_ids` [b, s] (--reset-attention-mask): attention stays
        within each document and the Mamba layers' convolution and state restart at each. Under context
        parallelism input_ids, position_ids and labels are this rank's chunks of the sequence
        (`parallel.context_parallel.slice_batch`) and document_ids the whole sequence's, in order."""
        offset = 0 if kv_cache is None else kv_cache.seq_len_offset
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids, offset)
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)
        elif self.decoder.input_tensor is None:
            raise RuntimeError("this pipeline stage has no embedding: call set_input_tensor before forward")
        else:
            hidden = self.decoder.input_tensor
        rotary = None if self.rotary_pos_emb is None else self.rotary_pos_emb(position_ids)
        mask = None
        if document_ids is not None and self.decoder.num_attention_layers:
            mask = self.document_mask(document_ids)
        hidden = self.decoder(hidden, rotary, kv_cache, mask, document_ids)
        if kv_cache is not None:
            kv_cache.seq_len_offset += input_ids.shape[1]
        if not self.post_process:
            return hidden
        return self.language_model_output(hidden, labels)

    def allocate_inference_cache(self, batch_size: int, max_seq_len: int) -> HybridCache:
        """An empty generation cache for this stage's layers on this TP rank."""
        weight = next(self.parameters())
        tp_size = state.group_size(self.pg_collection.tp)
        mamba_states = [
            layer.mixer.new_state(batch_size, weight.device)
            for layer in self.decoder.layers
            if isinstance(layer, MambaLayer)
        ]
        return HybridCache(
            mamba_states,
            num_layers=self.decoder.num_attention_layers,
            batch_size=batch_size,
            max_seq_len=max_seq_len,
            num_kv_heads=self.config.num_query_groups_effective // tp_size,
            head_dim=self.config.kv_channels,
            dtype=weight.dtype,
            device=weight.device,
        )
