"""What every language model here shares (Megatron-Core's language_module.py): the embeddings, the
vocab-parallel output layer, the tie between them, and the one per-token language-model loss.

GPT, BERT, T5, Retro and families registered from outside the project build on these pieces, so a loss or a
tied-embedding rule is written once (docs/architecture.md, model families).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.context_attention import ContextParallelDocuments
from megatron_train.models.norms import build_norm
from megatron_train.models.transformer import (
    OUTPUT_LAYER_INIT_STREAM,
    POSITION_EMBEDDING_INIT_STREAM,
    TOKENTYPE_EMBEDDING_INIT_STREAM,
    WORD_EMBEDDING_INIT_STREAM,
    document_causal_mask,
    init_method_normal,
)
from megatron_train.parallel.context_parallel import chunk_indices
from megatron_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_train.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron_train.parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_train.parallel.param_init import initialized
from megatron_train.parallel.random import get_rng_tracker, initialization_stream
from megatron_train.parallel.state import ProcessGroupCollection, group_rank, group_size, process_groups


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


def gathered_logits(
    logits: torch.Tensor, true_vocab_size: int | None, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """[s, b, v / TP] logits of this TP rank -> [b, s, v], -inf on the padding rows (never predicted)."""
    logits = gather_from_tensor_model_parallel_region(logits, tp_group).transpose(0, 1)
    if true_vocab_size is None or true_vocab_size >= logits.shape[-1]:  # no padding rows: no extra pass
        return logits.contiguous()
    padding = torch.arange(logits.shape[-1], device=logits.device) >= true_vocab_size
    return logits.masked_fill(padding, -torch.inf)


def compute_language_model_loss(
    labels: torch.Tensor,
    logits: torch.Tensor,
    true_vocab_size: int | None,
    tp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Per-token fp32 loss [b, s] of this TP rank's logits [s, b, v / TP] (the vocabulary split over `tp_group`)
    against `labels` [b, s] (Megatron-Core's `LanguageModule.compute_language_model_loss`). A label < 0 marks a
    position outside the loss (BERT's unmasked tokens, T5's decoder padding): its loss is 0. The padding rows of
    the vocabulary are left out of the softmax."""
    targets = labels.transpose(0, 1)
    losses = vocab_parallel_cross_entropy(logits, targets.clamp(min=0), true_vocab_size, tp_group)
    return (losses * (targets >= 0)).transpose(0, 1).contiguous()


class LanguageModelEmbedding(nn.Module):
    """Word (+ learned position) (+ token type) embeddings -> [s, b, h], scattered along the sequence under SP,
    normalised with post-LN layers (`config.post_ln`, as BERT), dropout. The vocabulary is split over
    `tp_group`."""

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        sequence_parallel: bool,
        init_seed: int | None = None,
        num_tokentypes: int = 0,
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group
        with initialization_stream(init_seed, WORD_EMBEDDING_INIT_STREAM):
            self.word_embeddings = VocabParallelEmbedding(
                vocab_size,
                config.hidden_size,
                init_method=vocab_init_method(config),
                params_dtype=config.params_dtype,
                tp_group=tp_group,
                weights_in_fp32=config.embedding_weights_in_fp32,
            )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            with initialization_stream(init_seed, POSITION_EMBEDDING_INIT_STREAM):
                self.position_embeddings = nn.Embedding(
                    config.max_position_embeddings, config.hidden_size, dtype=config.params_dtype
                )
                initialized(self.position_embeddings.weight, init_method_normal(config.init_method_std))
        self.tokentype_embeddings = None
        if num_tokentypes:
            with initialization_stream(init_seed, TOKENTYPE_EMBEDDING_INIT_STREAM):
                self.tokentype_embeddings = nn.Embedding(
                    num_tokentypes, config.hidden_size, dtype=config.params_dtype
                )
                initialized(self.tokentype_embeddings.weight, init_method_normal(config.init_method_std))
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
            embeddings = scatter_to_sequence_parallel_region(embeddings, self.tp_group)
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
    tp_group: dist.ProcessGroup | None = None,
) -> ColumnParallelLinear:
    """The last stage's output layer, its vocabulary split over `tp_group`; tied to the word embedding unless
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
            tp_group=tp_group,
        )
    if tied and not pre_process:
        # Megatron: the last stage's copy starts at zero; the pipeline engine all-reduces it with the
        # first stage's embedding over the embedding group, before training and after each backward.
        # `shared`: the grad norm counts this copy once, on the first stage (as Megatron-Core).
        initialized(output_layer.weight, nn.init.zeros_)
        output_layer.weight.shared_embedding = True
        output_layer.weight.shared = True
    return output_layer


class LanguageModule(nn.Module):
    """What every language model shares (Megatron-Core's LanguageModule): the word embedding on the first
    pipeline stage, tied to the output layer on the last, and the loss or logits of the output layer.
    Subclasses set `embedding` and `output_layer`, built over the groups of `pg_collection`."""

    embedding: LanguageModelEmbedding | None
    output_layer: ColumnParallelLinear | None
    input_stack: str = "decoder"  # the attribute holding the layer stack a pipeline stage's input enters

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        pre_process: bool,
        post_process: bool,
        has_output_layer: bool = True,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        """`vocab_size` is the padded vocabulary; `pre_process` / `post_process` say whether this pipeline stage
        holds the embedding / the output end; the output layer (when the model has one) is tied to the word
        embedding unless --untie-embeddings-and-output-weights. `pg_collection`: the process groups the model
        communicates over (default parallel.state's, `process_groups()`)."""
        super().__init__()
        self.config = config
        self.pg_collection = pg_collection or process_groups()
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

    def default_position_ids(self, input_ids: torch.Tensor, offset: int) -> torch.Tensor:
        """The positions [b, s] of `input_ids` when none are given: under context parallelism (the model's `cp`
        group) those of this rank's chunks of the sequence, else offset .. offset + s - 1 (a generation cache's
        offset); learned absolute embeddings refuse positions past their table."""
        batch, seq = input_ids.shape
        cp_group = self.pg_collection.cp
        cp_size = group_size(cp_group)
        if cp_size > 1:
            return chunk_indices(seq * cp_size, cp_size, group_rank(cp_group), input_ids.device).expand(
                batch, seq
            )
        limit = self.config.max_position_embeddings
        if self.config.position_embedding_type == "learned_absolute" and offset + seq > limit:
            raise ValueError(
                f"positions up to {offset + seq} exceed --max-position-embeddings {limit}; "
                "shorten the input or build the model with a larger table"
            )
        return torch.arange(offset, offset + seq, device=input_ids.device).expand(batch, seq)

    def document_mask(self, document_ids: torch.Tensor) -> torch.Tensor | ContextParallelDocuments:
        """The attention mask of documents [b, s] (--reset-attention-mask, packed SFT): the dense document-causal
        mask [b, 1, s, s]; under context parallelism the whole sequence's ids, from which the context-parallel
        attention builds each block's mask."""
        if group_size(self.pg_collection.cp) > 1:
            return ContextParallelDocuments(document_ids)
        return document_causal_mask(document_ids)

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """Hidden states [s, b, h] from the previous pipeline stage (Megatron's hook; lists are unwrapped)."""
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        getattr(self, self.input_stack).input_tensor = input_tensor

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The weight tied between the word embedding and the output layer on this stage, if any."""
        if not self.share_embeddings_and_output_weights:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight if self.post_process else None

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This TP rank's logits [s, b, v / TP] of hidden states [s, b, h] (all gathered along the sequence
        under SP)."""
        return self.output_layer(hidden, weight=self.shared_embedding_or_output_weight())

    def language_model_output(self, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The output end of every LM here: per-token fp32 losses [b, s] with `labels` (< 0: outside the loss),
        else the logits [b, s, vocab] gathered across TP with -inf on the padding rows."""
        logits, tp_group = self.output_logits(hidden), self.pg_collection.tp
        if labels is None:
            return gathered_logits(logits, self.config.true_vocab_size, tp_group)
        return compute_language_model_loss(labels, logits, self.config.true_vocab_size, tp_group)
