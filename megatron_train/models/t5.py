"""T5Model: Megatron-Core's T5 on the GPT transformer layers, so TP/SP/recompute/bf16/fp16 apply unchanged.

One word embedding shared by encoder and decoder (+ learned absolute positions, Megatron's default, or T5's
bucketed relative position bias with `--position-embedding-type relative`), an encoder block bidirectional
over the encoder's padding, a decoder block of causal self-attention + cross-attention over the encoder
output, and Megatron's T5 LM head: the output layer tied to the word embedding, with a bias. Hugging Face T5
v1.0 weights load into it exactly (`models.hf_t5`). No pipeline parallelism, as Megatron's pretrain_t5
(docs/architecture.md, T5).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.cross_attention import CrossAttention
from megatron_train.models.language_module import LanguageModelEmbedding, LanguageModule, build_output_layer
from megatron_train.models.transformer import (
    DECODER_RELATIVE_BIAS_INIT_STREAM,
    ENCODER_RELATIVE_BIAS_INIT_STREAM,
    FIRST_LAYER_INIT_STREAM,
    TransformerBlock,
    init_method_normal,
)
from megatron_train.parallel import state
from megatron_train.parallel.layers import parallel_weight
from megatron_train.parallel.random import initialization_stream
from megatron_train.parallel.state import ProcessGroupCollection


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each (key - query) distance: exact below num_buckets / 2 (of each direction when
    bidirectional), then logarithmic up to `max_distance`, beyond which all distances share the last bucket."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -relative_position.clamp(max=0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = (
        max_exact
        + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, relative_position, large)


class RelativePositionBias(nn.Module):
    """T5's learned bias per (bucket, head) added to the attention scores of every layer of one block.

    `weight` [buckets, heads] is split over `tp_group` along the heads (partition_dim 1): each rank holds the
    columns of its own attention heads, initialised like every TP layer (`layers.parallel_weight`).
    """

    def __init__(
        self, config: TransformerConfig, bidirectional: bool, tp_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.weight = parallel_weight(
            (self.num_buckets, config.num_attention_heads),
            1,
            1,
            init_method_normal(config.init_method_std),
            config.params_dtype,
            tp_group,
        )

    def forward(self, query_length: int, key_length: int) -> torch.Tensor:
        """[1, this rank's heads, query_length, key_length]."""
        device = self.weight.device
        relative = (
            torch.arange(key_length, device=device)[None, :]
            - torch.arange(query_length, device=device)[:, None]
        )
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self.weight[buckets].permute(2, 0, 1).unsqueeze(0)


def attention_bias(bias: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The additive attention mask: `bias` where `allowed` (bool, broadcastable), the dtype's minimum elsewhere
    (as Hugging Face T5: a row with nothing allowed stays finite)."""
    return bias.masked_fill(~allowed, torch.finfo(bias.dtype).min)


class T5Model(LanguageModule):
    """T5 for span-corruption pretraining: encoder input and padding mask, decoder input -> decoder LM output.

    The arguments are GPTModel's (`vocab_size` padded, `sequence_parallel`, `init_seed` for
    --use-cpu-initialization, `vp_stage`, always 0 without pipeline stages). The encoder has `config.num_layers` layers, the decoder
    `config.num_decoder_layers`; parameter names are Megatron-Core's (`encoder.layers.N.`, `decoder.layers.N.`,
    `decoder.layers.N.cross_attention.`, `output_layer.bias`).
    """

    model_type = "t5"  # recorded in checkpoints (checkpointing.save)

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
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config, vocab_size, pre_process, post_process, pg_collection=pg_collection)
        tp_group = self.pg_collection.tp
        if not (pre_process and post_process) or state.group_size(self.pg_collection.pp) > 1:
            raise ValueError(
                "T5 is not split across pipeline stages: use --pipeline-model-parallel-size 1 (TP, SP and DP apply)"
            )
        if config.position_embedding_type not in ("learned_absolute", "relative"):
            raise ValueError(
                "T5 takes --position-embedding-type learned_absolute or relative, not "
                f"{config.position_embedding_type}"
            )
        self.embedding = LanguageModelEmbedding(
            config, vocab_size, sequence_parallel, init_seed, tp_group=tp_group
        )
        self.encoder_relative_position = self.decoder_relative_position = None
        if config.position_embedding_type == "relative":
            with initialization_stream(init_seed, ENCODER_RELATIVE_BIAS_INIT_STREAM):
                self.encoder_relative_position = RelativePositionBias(config, True, tp_group)
            with initialization_stream(init_seed, DECODER_RELATIVE_BIAS_INIT_STREAM):
                self.decoder_relative_position = RelativePositionBias(config, False, tp_group)
        self.encoder = TransformerBlock(
            config, sequence_parallel, True, init_seed, vp_stage, pg_collection=self.pg_collection
        )
        decoder_config = dataclasses.replace(
            config, num_layers=config.num_decoder_layers, encoder_num_layers=None
        )
        self.decoder = TransformerBlock(
            decoder_config,
            sequence_parallel,
            True,
            init_seed,
            vp_stage,
            cross_attention_for=lambda _: CrossAttention(decoder_config, sequence_parallel, tp_group),
            first_init_stream=FIRST_LAYER_INIT_STREAM + config.num_layers,
            pg_collection=self.pg_collection,
        )
        self.output_layer = build_output_layer(
            config, vocab_size, True, sequence_parallel, init_seed, bias=True, tp_group=tp_group
        )

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """The schedules' hook: without pipeline stages there is never an input tensor."""
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0] if input_tensor else None
        if input_tensor is not None:
            raise RuntimeError("T5 has no pipeline stages: it takes no input tensor")

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch, seq = input_ids.shape
        if self.embedding.position_embeddings is not None and seq > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {seq} tokens exceeds --max-position-embeddings {self.config.max_position_embeddings}"
            )
        return self.embedding(input_ids, torch.arange(seq, device=input_ids.device).expand(batch, seq))

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder output [s, b, h] (this rank's sequence shard under SP). `attention_mask` [b, s]: 1 on
        tokens, 0 on padding (keys never attended); None: no padding."""
        seq = input_ids.shape[1]
        key_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        mask = key_mask
        if self.encoder_relative_position is not None:
            bias = self.encoder_relative_position(seq, seq)
            mask = bias if key_mask is None else attention_bias(bias, key_mask)
        return self.encoder(self._embed(input_ids), attention_mask=mask)

    def decode(
        self,
        input_ids: torch.Tensor,
        encoder_output: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder output [s, b, h]: causal self-attention, cross-attention to `encoder_output` over the
        unpadded encoder positions. Padding follows the tokens, so no real position sees it causally."""
        seq = input_ids.shape[1]
        mask = None  # causal
        if self.decoder_relative_position is not None:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).tril()
            mask = attention_bias(self.decoder_relative_position(seq, seq), causal)
        context_mask = None
        if encoder_attention_mask is not None:
            context_mask = encoder_attention_mask.bool()[:, None, None, :]
        return self.decoder(
            self._embed(input_ids), attention_mask=mask, context=encoder_output, context_mask=context_mask
        )

    def forward(
        self,
        encoder_input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        lm_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token fp32 LM loss [b, s_dec] with `lm_labels` (labels < 0 are outside the loss: 0 there), else
        the decoder's logits [b, s_dec, vocab] gathered across TP with -inf on the padding rows."""
        encoder_output = self.encode(encoder_input_ids, encoder_attention_mask)
        hidden = self.decode(decoder_input_ids, encoder_output, encoder_attention_mask)
        return self.language_model_output(hidden, lm_labels)
