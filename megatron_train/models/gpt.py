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
from megatron_train.models.norms import build_norm
from megatron_train.models.rotary import RotaryEmbedding
from megatron_train.models.transformer import (
    OUTPUT_LAYER_INIT_STREAM,
    POSITION_EMBEDDING_INIT_STREAM,
    TOKENTYPE_EMBEDDING_INIT_STREAM,
    WORD_EMBEDDING_INIT_STREAM,
    TransformerBlock,
    document_causal_mask,
    init_method_normal,
)
from megatron_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_train.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron_train.parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_train.parallel.random import get_rng_tracker, initialization_stream


def vocab_init_method(config: TransformerConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """Normal init of a [padded vocab, hidden] master weight: the true vocabulary's rows drawn first, the
    padding rows after, so the real rows do not depend on how much padding the TP size adds."""
    init = init_method_normal(config.init_method_std)

    def init_rows(master: torch.Tensor) -> torch.Tensor:
        true_rows = master.shape[0] if config.true_vocab_size is None else config.true_vocab_size
        init(master[:true_rows])
        init(master[true_rows:])
        return master

    return init_rows


def gathered_logits(logits: torch.Tensor, true_vocab_size: int | None) -> torch.Tensor:
    """[s, b, v / TP] logits of this TP rank -> [b, s, v], -inf on the padding rows (never predicted)."""
    logits = gather_from_tensor_model_parallel_region(logits).transpose(0, 1)
    if true_vocab_size is None or true_vocab_size >= logits.shape[-1]:  # no padding rows: no extra pass
        return logits.contiguous()
    padding = torch.arange(logits.shape[-1], device=logits.device) >= true_vocab_size
    return logits.masked_fill(padding, -torch.inf)


class LanguageModelEmbedding(nn.Module):
    """Word (+ learned position) (+ token type) embeddings -> [s, b, h], scattered along the sequence under SP,
    normalised with post-LN layers (`config.post_ln`, as BERT), dropout."""

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        sequence_parallel: bool,
        init_seed: int | None = None,
        num_tokentypes: int = 0,
    ) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        with initialization_stream(init_seed, WORD_EMBEDDING_INIT_STREAM):
            self.word_embeddings = VocabParallelEmbedding(
                vocab_size,
                config.hidden_size,
                init_method=vocab_init_method(config),
                params_dtype=config.params_dtype,
            )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            with initialization_stream(init_seed, POSITION_EMBEDDING_INIT_STREAM):
                self.position_embeddings = nn.Embedding(
                    config.max_position_embeddings, config.hidden_size, dtype=config.params_dtype
                )
                init_method_normal(config.init_method_std)(self.position_embeddings.weight)
        self.tokentype_embeddings = None
        if num_tokentypes:
            with initialization_stream(init_seed, TOKENTYPE_EMBEDDING_INIT_STREAM):
                self.tokentype_embeddings = nn.Embedding(
                    num_tokentypes, config.hidden_size, dtype=config.params_dtype
                )
                init_method_normal(config.init_method_std)(self.tokentype_embeddings.weight)
        self.layernorm = build_norm(config, sequence_parallel) if config.post_ln else None
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        tokentype_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Looked up in [s, b] order, so the embeddings come out in the model's layout without a transpose copy.
        embeddings = self.word_embeddings(input_ids.transpose(0, 1))
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids.transpose(0, 1))
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                raise ValueError("this model has token type embeddings: pass tokentype_ids ([b, s] of 0/1)")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids.transpose(0, 1))
        if self.sequence_parallel:
            embeddings = scatter_to_sequence_parallel_region(embeddings)
        if self.layernorm is not None:
            embeddings = self.layernorm(embeddings)
        if not self.sequence_parallel:
            return self.embedding_dropout(embeddings)
        with get_rng_tracker().fork():  # each TP rank drops out its own sequence shard
            return self.embedding_dropout(embeddings)


def build_output_layer(
    config: TransformerConfig,
    vocab_size: int,
    pre_process: bool,
    sequence_parallel: bool,
    init_seed: int | None,
    bias: bool = False,
) -> ColumnParallelLinear:
    """The last stage's vocab-parallel output layer; tied to the word embedding unless
    `config.untie_embeddings_and_output_weights` (no weight of its own when this stage also holds the embedding)."""
    tied = not config.untie_embeddings_and_output_weights
    with initialization_stream(init_seed, OUTPUT_LAYER_INIT_STREAM):
        output_layer = ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            init_method=vocab_init_method(config),
            bias=bias,
            sequence_parallel=sequence_parallel,
            skip_weight_param_allocation=pre_process and tied,
            params_dtype=config.params_dtype,
        )
    if tied and not pre_process:
        # Megatron: the last stage's copy starts at zero; the pipeline engine all-reduces it with the
        # first stage's embedding over the embedding group, before training and after each backward.
        # `shared`: the grad norm counts this copy once, on the first stage (as Megatron-Core).
        output_layer.weight.data.zero_()
        output_layer.weight.shared_embedding = True
        output_layer.weight.shared = True
    return output_layer


class LanguageModule(nn.Module):
    """What GPT and BERT share (Megatron-Core's LanguageModule): the word embedding on the first pipeline
    stage, tied to the output layer on the last. Subclasses set `embedding` and `output_layer`."""

    embedding: LanguageModelEmbedding | None
    output_layer: ColumnParallelLinear | None

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        pre_process: bool,
        post_process: bool,
        has_output_layer: bool = True,
    ) -> None:
        """`vocab_size` is the padded vocabulary; `pre_process` / `post_process` say whether this pipeline stage
        holds the embedding / the output end; the output layer (when the model has one) is tied to the word
        embedding unless --untie-embeddings-and-output-weights."""
        super().__init__()
        self.config = config
        self.vocab_size = vocab_size
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = (
            has_output_layer and not config.untie_embeddings_and_output_weights
        )

    def mark_first_stage_embedding_copy(self) -> None:
        """The first stage's copy of the tied word embedding (parallel.tied_embeddings), when the output layer
        lives on another stage."""
        if self.share_embeddings_and_output_weights and self.pre_process and not self.post_process:
            self.embedding.word_embeddings.weight.shared_embedding = True

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The weight tied between the word embedding and the output layer on this stage, if any."""
        if not self.share_embeddings_and_output_weights:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight if self.post_process else None


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
    cross-attention), which attends to the `context` passed to forward.
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
    ) -> None:
        super().__init__(config, vocab_size, pre_process, post_process)
        if config.position_embedding_type == "relative":
            raise ValueError(
                "--position-embedding-type relative is T5's attention bias; GPT takes learned_absolute or rope"
            )
        self.embedding = (
            LanguageModelEmbedding(config, vocab_size, sequence_parallel, init_seed) if pre_process else None
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
            config, sequence_parallel, post_process, init_seed, vp_stage, cross_attention_for
        )
        self.output_layer = (
            build_output_layer(config, vocab_size, pre_process, sequence_parallel, init_seed)
            if post_process
            else None
        )

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """Hidden states [s, b, h] from the previous pipeline stage (Megatron's hook; lists are unwrapped)."""
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.decoder.input_tensor = input_tensor

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
        """
        batch, seq = input_ids.shape
        offset = 0 if kv_cache is None else kv_cache.seq_len_offset
        if position_ids is None:
            limit = self.config.max_position_embeddings
            if self.config.position_embedding_type == "learned_absolute" and offset + seq > limit:
                raise ValueError(
                    f"positions up to {offset + seq} exceed --max-position-embeddings {limit}; "
                    "shorten the input or build the model with a larger table"
                )
            position_ids = torch.arange(offset, offset + seq, device=input_ids.device).expand(batch, seq)

        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)
        elif self.decoder.input_tensor is None:
            raise RuntimeError("this pipeline stage has no embedding: call set_input_tensor before forward")
        else:
            hidden = self.decoder.input_tensor
        rotary = None if self.rotary_pos_emb is None else self.rotary_pos_emb(position_ids)
        mask = None if document_ids is None else document_causal_mask(document_ids)
        hidden = self.decoder(hidden, rotary, kv_cache, mask, context=context, context_mask=context_mask)
        if kv_cache is not None:
            kv_cache.seq_len_offset += seq
        if not self.post_process:
            return hidden

        logits = self.output_layer(hidden, weight=self.shared_embedding_or_output_weight())  # [s, b, v / TP]
        true_vocab_size = self.config.true_vocab_size
        if labels is None:
            return gathered_logits(logits, true_vocab_size)
        losses = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), true_vocab_size)
        return losses.transpose(0, 1).contiguous()


def model_provider(
    config: TransformerConfig,
    vocab_size: int,
    pre_process: bool = True,
    post_process: bool = True,
    *,
    sequence_parallel: bool = False,
    init_seed: int | None = None,
    vp_stage: int = 0,
) -> GPTModel:
    """Build the GPT model for this rank (Megatron's `model_provider` hook for the training loop)."""
    return GPTModel(
        config,
        vocab_size,
        pre_process,
        post_process,
        sequence_parallel=sequence_parallel,
        init_seed=init_seed,
        vp_stage=vp_stage,
    )
