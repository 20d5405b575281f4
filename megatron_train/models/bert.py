"""BertModel: Megatron-Core's BERT on the GPT transformer layers, so TP/SP/PP/recompute/bf16/fp16 apply unchanged.

Word + learned position + token type embeddings, a bidirectional encoder over the padding mask, the LM head
(dense, GELU, norm, then the vocab-parallel output layer tied to the word embedding, with a bias), and the
pooler with the binary (sentence order / next sentence) head. Megatron's pre-norm layers by default;
`TransformerConfig.post_ln` gives the original BERT layer, in which Hugging Face checkpoints load exactly
(`models.hf_bert`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_train.models.config import TransformerConfig
from megatron_train.models.language_module import (
    LanguageModelEmbedding,
    LanguageModule,
    build_output_layer,
    compute_language_model_loss,
)
from megatron_train.models.norms import build_norm
from megatron_train.models.transformer import (
    BINARY_HEAD_INIT_STREAM,
    LM_HEAD_INIT_STREAM,
    POOLER_INIT_STREAM,
    TransformerBlock,
    init_method_normal,
)
from megatron_train.parallel.mappings import gather_from_sequence_parallel_region
from megatron_train.parallel.param_init import initialized
from megatron_train.parallel.random import initialization_stream
from megatron_train.parallel.state import ProcessGroupCollection


def linear_layer(config: TransformerConfig, in_features: int, out_features: int) -> nn.Linear:
    """A replicated linear layer as Megatron's `get_linear_layer`: normal weights, zero bias."""
    layer = nn.Linear(in_features, out_features, dtype=config.params_dtype)
    initialized(layer.weight, init_method_normal(config.init_method_std))
    initialized(layer.bias, nn.init.zeros_)
    return layer


class BertLMHead(nn.Module):
    """dense -> GELU -> norm on every token, before the output layer (Megatron-Core's BertLMHead: the exact GELU,
    or its tanh approximation with --openai-gelu; the MLP's bias-GELU fusion does not reach the head)."""

    def __init__(self, config: TransformerConfig, sequence_parallel: bool) -> None:
        super().__init__()
        self.dense = linear_layer(config, config.hidden_size, config.hidden_size)
        for param in self.dense.parameters():  # applied to this rank's sequence shard: grads summed over TP
            param.sequence_parallel = sequence_parallel
        self.layer_norm = build_norm(config, sequence_parallel)
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden), approximate=self.gelu_approximate))


class Pooler(nn.Module):
    """tanh(dense(hidden state of the first token, [CLS])) -> [b, h]; gathers the sequence over `tp_group` under
    SP."""

    def __init__(
        self, config: TransformerConfig, sequence_parallel: bool, tp_group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group
        self.dense = linear_layer(config, config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            # every TP rank runs the pooler on the whole sequence: the backward keeps its own slice, no sum
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return torch.tanh(self.dense(hidden[0]))


class BertModel(LanguageModule):
    """BERT for masked-LM pretraining with an optional binary head.

    The arguments are GPTModel's (`vocab_size` padded, `pre_process` / `post_process` the pipeline stage's
    ends, `sequence_parallel`, `init_seed` for --use-cpu-initialization, `vp_stage`), plus `num_tokentypes`
    (default Megatron's pretrain_bert: 2 with the binary head, else 0; Hugging Face BERT always has 2),
    `add_binary_head`, and for
    the downstream task heads (`tasks.finetune.model`) `add_lm_head=False` / `add_pooler=True`.
    """

    model_type = "bert"  # recorded in checkpoints (checkpointing.save)
    input_stack = "encoder"

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        pre_process: bool = True,
        post_process: bool = True,
        *,
        num_tokentypes: int | None = None,
        add_binary_head: bool = True,
        add_lm_head: bool = True,
        add_pooler: bool = False,
        sequence_parallel: bool = False,
        init_seed: int | None = None,
        vp_stage: int = 0,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(
            config,
            vocab_size,
            pre_process,
            post_process,
            has_output_layer=add_lm_head,
            pg_collection=pg_collection,
        )
        tp_group = self.pg_collection.tp
        if config.position_embedding_type != "learned_absolute":
            raise ValueError(
                f"BERT uses learned absolute positions; got --position-embedding-type "
                f"{config.position_embedding_type}"
            )
        self.add_binary_head = add_binary_head
        self.sequence_parallel = sequence_parallel
        if num_tokentypes is None:
            num_tokentypes = 2 if add_binary_head else 0
        self.embedding = (
            LanguageModelEmbedding(config, vocab_size, sequence_parallel, init_seed, num_tokentypes, tp_group)
            if pre_process
            else None
        )
        self.mark_first_stage_embedding_copy()
        self.encoder = TransformerBlock(
            config, sequence_parallel, post_process, init_seed, vp_stage, pg_collection=self.pg_collection
        )
        self.lm_head = self.output_layer = self.pooler = self.binary_head = None
        if post_process and add_lm_head:
            with initialization_stream(init_seed, LM_HEAD_INIT_STREAM):
                self.lm_head = BertLMHead(config, sequence_parallel)
            self.output_layer = build_output_layer(
                config, vocab_size, pre_process, sequence_parallel, init_seed, bias=True, tp_group=tp_group
            )
        if post_process and (add_binary_head or add_pooler):
            with initialization_stream(init_seed, POOLER_INIT_STREAM):
                self.pooler = Pooler(config, sequence_parallel, tp_group)
        if post_process and add_binary_head:
            with initialization_stream(init_seed, BINARY_HEAD_INIT_STREAM):
                self.binary_head = linear_layer(config, config.hidden_size, 2)

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The encoder's hidden states [s, b, h] (this stage's sequence shard under SP); `tokentype_ids` [b, s]
        default to segment 0.

        `attention_mask` [b, s]: 1 on tokens, 0 on padding (every position attends to every unpadded one);
        None attends to all positions.
        """
        batch, seq = input_ids.shape
        if tokentype_ids is None and self.pre_process and self.embedding.tokentype_embeddings is not None:
            tokentype_ids = torch.zeros_like(input_ids)  # one segment, as Hugging Face's default
        if attention_mask is None:
            attention_mask = torch.ones(batch, seq, dtype=torch.bool, device=input_ids.device)
        key_mask = attention_mask.bool()[:, None, None, :]  # [b, 1, 1, s]: which keys each query sees
        if self.pre_process:
            if seq > self.config.max_position_embeddings:
                raise ValueError(
                    f"sequence of {seq} tokens exceeds --max-position-embeddings "
                    f"{self.config.max_position_embeddings}"
                )
            position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
            hidden = self.embedding(input_ids, position_ids, tokentype_ids)
        elif self.encoder.input_tensor is None:
            raise RuntimeError("this pipeline stage has no embedding: call set_input_tensor before forward")
        else:
            hidden = self.encoder.input_tensor
        return self.encoder(hidden, attention_mask=key_mask)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
        lm_labels: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """(per-token fp32 LM loss [b, s] with `lm_labels`, else MLM logits [b, s, vocab] gathered across TP
        with -inf on padding rows; binary logits [b, 2] or None) on the last stage; hidden states [s, b, h]
        (the next stage's input) elsewhere. Labels < 0 mark the positions outside the loss: their loss is 0."""
        hidden = self.encode(input_ids, attention_mask, tokentype_ids)
        if not self.post_process:
            return hidden
        binary_logits = None
        if self.binary_head is not None:
            binary_logits = self.binary_head(self.pooler(hidden)).float()
        hidden = self.lm_head(hidden)
        if lm_labels is None or self.sequence_parallel:
            # under SP the output layer gathers the sequence shards: every position's logits
            return self.language_model_output(hidden, lm_labels), binary_logits
        # Only the masked positions (labels >= 0, about 15%) go through the output layer, the largest GEMM of
        # the model; the loss of the others is 0, as the loss mask makes it anyway.
        labels = lm_labels.transpose(0, 1)  # [s, b], the hidden states' layout
        masked = labels >= 0
        logits = self.output_logits(hidden[masked].unsqueeze(1))  # [n, 1, v / TP]
        masked_losses = compute_language_model_loss(
            labels[masked].unsqueeze(0), logits, self.config.true_vocab_size, tp_group=self.pg_collection.tp
        )  # [1, n]
        losses = masked_losses.new_zeros(labels.shape).index_put((masked,), masked_losses.squeeze(0))
        return losses.transpose(0, 1).contiguous(), binary_logits
