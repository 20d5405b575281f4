"""The downstream task model: a BERT encoder and pooler with a classification head, as Megatron's legacy
Classification (MNLI, QQP: one logit per class) and MultipleChoice (RACE: one logit per option, the options
folded into the batch) models; and the load of a pretrained BERT checkpoint into it.

The pretrained checkpoint's LM head and binary head are left out; the task head (and a pooler or token-type
embedding a BERT trained with --bert-no-binary-head lacks) starts from random weights, with a warning, as in
Megatron's finetune_utils.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import CheckpointError, resolve_iteration_dir
from megatron_train.checkpointing.load import check_compatible
from megatron_train.checkpointing.names import global_names, saved_model_type
from megatron_train.checkpointing.saved import SavedCheckpoint
from megatron_train.models.bert import BertModel, linear_layer
from megatron_train.models.config import TransformerConfig
from megatron_train.models.transformer import BINARY_HEAD_INIT_STREAM
from megatron_train.parallel import state
from megatron_train.parallel.random import initialization_stream

logger = logging.getLogger(__name__)

# Parts a pretrained BERT may lack: the task head always, the pooler and token types without its binary head.
MAY_START_RANDOM = ("classification_head.", "pooler.", "embedding.tokentype_embeddings.")


class BertClassifier(BertModel):
    """BERT (two token types, pooler, no LM head) with dropout and a linear head on the pooled [CLS] state.

    `num_classes` logits per sequence; for multiple choice `num_classes=1` and the input is [b, choices, s],
    which returns [b, choices] logits (one per option).
    """

    model_type = "bert_classifier"  # recorded in finetuned checkpoints, refused by pretrain_bert

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        num_classes: int,
        *,
        sequence_parallel: bool = False,
        init_seed: int | None = None,
    ) -> None:
        super().__init__(
            config,
            vocab_size,
            num_tokentypes=2,
            add_binary_head=False,
            add_lm_head=False,
            add_pooler=True,
            sequence_parallel=sequence_parallel,
            init_seed=init_seed,
        )
        self.num_classes = num_classes
        self.classification_dropout = nn.Dropout(config.hidden_dropout)
        with initialization_stream(init_seed, BINARY_HEAD_INIT_STREAM):
            self.classification_head = linear_layer(config, config.hidden_size, num_classes)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [b, num_classes] (fp32), or [b, choices] for a [b, choices, s] input."""
        choices = input_ids.shape[1] if input_ids.dim() == 3 else None
        if choices is not None:  # fold the options into the batch
            input_ids, attention_mask, tokentype_ids = (
                None if t is None else t.reshape(-1, t.shape[-1])
                for t in (input_ids, attention_mask, tokentype_ids)
            )
        pooled = self.pooler(self.encode(input_ids, attention_mask, tokentype_ids))
        logits = self.classification_head(self.classification_dropout(pooled)).float()
        return logits.view(-1, choices) if choices is not None else logits


def check_bert_checkpoint(metadata: dict, where: str) -> None:
    """Refuse a checkpoint that holds no BERT encoder (a GPT's, say) before anything is built."""
    kind = saved_model_type(metadata)
    if kind not in ("bert", BertClassifier.model_type):
        raise CheckpointError(
            f"--pretrained-checkpoint {where} holds a {kind} model; finetuning needs a BERT (pretrain_bert) checkpoint"
        )


def load_pretrained_bert(
    model: BertClassifier, pretrained: str, config: MegatronConfig, padded_vocab_size: int
) -> str:
    """Load the encoder (and pooler, token types) of the BERT checkpoint in `pretrained` into this rank's part
    of `model`, resharded to this run's TP size; returns the iteration folder read.

    Refuses a checkpoint of another model family or shape; a missing weight other than `MAY_START_RANDOM`'s is
    an error naming it.
    """
    iteration_dir = resolve_iteration_dir(pretrained, None)
    if iteration_dir is None:
        raise CheckpointError(
            f"--pretrained-checkpoint {pretrained}: no latest_checkpointed_iteration.txt; pass the --save "
            "folder of a pretrain_bert run"
        )
    saved = SavedCheckpoint(iteration_dir)
    check_bert_checkpoint(saved.metadata, iteration_dir)
    check_compatible(saved.metadata, config, padded_vocab_size, iteration_dir)
    tp_size, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    weights, missing = {}, []
    for local, name in global_names(model, config).items():
        if name in saved.params:
            weights[local] = saved.tensor_for(name, "model", tp_size, tp_rank, padded_vocab_size)
        elif local.startswith(MAY_START_RANDOM):
            missing.append(local)
        else:
            raise CheckpointError(
                f"--pretrained-checkpoint {iteration_dir} holds no weight {name!r}: it was saved from a different "
                "model; pass a pretrain_bert checkpoint of this shape"
            )
    model.load_state_dict(weights, strict=False)
    if missing and state.get_data_parallel_rank() == 0 and tp_rank == 0:
        logger.warning("%s has no %s: initialized at random", iteration_dir, ", ".join(missing))
    return iteration_dir
