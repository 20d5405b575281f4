"""GPTModel: embeddings, the transformer block and the output layer, with Megatron's pipeline hooks.

Covers GPT-2 and Llama (see TransformerConfig). Under tensor parallelism the word embedding and output
layer are split along the vocabulary and the loss is computed without gathering the logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.kv_cache import KVCache
from megatron_train.models.language_module import LanguageModelEmbedding, LanguageModule, build_output_layer
from megatron_train.models.rotary import RotaryEmbedding
from megatron_train.models.transformer import TransformerBlock
from megatron_train.parallel.state import ProcessGroupCollection


class GPTModel(LanguageModule):
    """Decoder-only transformer LM.

    `vocab_size` is the padded vocabulary (divisible by the TP size); `config.true_vocab_size` the tokenizer's,
    whose padding rows the loss and the returned logits leave out (-inf), so every TP size (every padding) gives
    the same losses and probabilities. `pre_process` / `post_process` say whether this pipeline stage holds the
    embedding / the final norm and output layer; a stage without the embedding takes its input from
    `set_input_tensor`. `sequence_parallel` is `--sequence-parallel`; `vp_stage` the model chunk this is of
    the rank's stage under the interleaved schedule (it picks the layers). `init_seed` (--use-cpu-initialization)
    draws each part's weights from its own stream of that seed, the same full weights under every layout.
    `cross_attention_for(global layer number)` gives layers a cross-attention module (Retro's chunked
    cross-attention), which attends to the `context` passed to forward. `pg_collection`: the process groups the
    layers communicate over (the model provider's; default parallel.state's).
    """

    model_type = "gpt"  # recorded in checkpoints (checkpointing.save)

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        pre_process: bool = True,
        post_process: bool = True,
        *,
        sequence_parallel: bool = False,
        init_seed: int | None = None,
        vp_stage: int = 0,
        cross_attention_for: Callable[[int], nn.Module | None] | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config, vocab_size, pre_process, post_process, pg_collection=pg_collection)
        tp_group = self.pg_collection.tp
        if config.position_embedding_type == "relative":
            raise ValueError(
                "--position-embedding-type relative is T5's attention bias; GPT takes learned_absolute, rope or none"
            )
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
        self.decoder = TransformerBlock(
            config,
            sequence_parallel,
            post_process,
            init_seed,
            vp_stage,
            cross_attention_for,
            pg_collection=self.pg_collection,
        )
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
        kv_cache: KVCache | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token fp32 loss [b, s] with labels; else logits [b, s, vocab] (gathered across TP).

        A stage without post_process returns its hidden states [s, b, h] (the next stage's input).
        With a KV cache, input_ids are the new tokens only; positions continue from the cache's offset.
        `context` / `context_mask` go to the layers' cross-attention (Megatron-Core's extra_block_kwargs).
        `document_ids` [b, s] (--reset-attention-mask, packed SFT): each token attends within its document only.
        Under context parallelism (the model's `cp` group) input_ids, position_ids and labels are this rank's
        chunks of the sequence (`parallel.context_parallel.slice_batch`) and document_ids the whole sequence's.
        """
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
        mask = None if document_ids is None else self.document_mask(document_ids)
        hidden = self.decoder(hidden, rotary, kv_cache, mask, context=context, context_mask=context_mask)
        if kv_cache is not None:
            kv_cache.seq_len_offset += input_ids.shape[1]
        if not self.post_process:
            return hidden

        return self.language_model_output(hidden, labels)
