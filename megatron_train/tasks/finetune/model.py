"""The downstream task model: a BERT encoder and pooler with a classification head, as Megatron's legacy
Classification (MNLI, QQP: one logit per class) and MultipleChoice (RACE: one logit per option, the options
folded into the batch) models; and the load of a pretrained BERT checkpoint into it.

The pretrained checkpoint's LM head and binary head are left out; the task head (and a pooler or token-type
embedding a BERT trained with --bert-no-binary-head lacks) starts from random weights, with a warning, as in
Megatron's finetune_utils.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import CheckpointError, resolve_iteration_dir
from megatron_train.checkpointing.load import check_compatible
from megatron_train.checkpointing.names import global_names
from megatron_train.checkpointing.saved import SavedCheckpoint
from megatron_train.device import get_device
from megatron_train.families.bert import BERT, ENCODER_PIPELINE, encoder_terms
from megatron_train.families.family import Layouts, ModelFamily
from megatron_train.families.registry import saved_family_name
from megatron_train.models.bert import BertModel, linear_layer
from megatron_train.models.config import TransformerConfig
from megatron_train.models.terms import ModelTerms, WeightTerm
from megatron_train.models.transformer import BINARY_HEAD_INIT_STREAM
from megatron_train.parallel import state
from megatron_train.parallel.random import initialization_stream
from megatron_train.parallel.schedules import LossFunc
from megatron_train.parallel.state import ProcessGroupCollection
from megatron_train.training.loop import get_batch

logger = logging.getLogger(__name__)

# Parts a pretrained BERT may lack: the task head always, the pooler and token types without its binary head.
MAY_START_RANDOM = ("classification_head.", "pooler.", "embedding.tokentype_embeddings.")


class BertClassifier(BertModel):
    """BERT (two token types, pooler, no LM head) with dropout and a linear head on the pooled [CLS] state.

    `num_classes` logits per sequence; for multiple choice `num_classes=1` and the input is [b, choices, s],
    which returns [b, choices] logits (one per option). One pipeline stage: `pre_process`, `post_process` and
    `vp_stage` are BertModel's, always the whole model.
    """

    model_type = "bert_classifier"  # recorded in finetuned checkpoints, refused by pretrain_bert

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        pre_process: bool = True,
        post_process: bool = True,
        *,
        num_classes: int,
        vp_stage: int = 0,
        sequence_parallel: bool = False,
        init_seed: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(
            config,
            vocab_size,
            pre_process,
            post_process,
            vp_stage=vp_stage,
            num_tokentypes=2,
            add_binary_head=False,
            add_lm_head=False,
            add_pooler=True,
            sequence_parallel=sequence_parallel,
            init_seed=init_seed,
            pg_collection=pg_collection,
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


def cross_entropy_loss(
    labels: torch.Tensor, logits: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's finetuning loss, logged under its name `lm loss`."""
    loss = F.cross_entropy(logits.float(), labels)
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator: Iterator, model: torch.nn.Module) -> tuple[torch.Tensor, LossFunc]:
    batch = get_batch(data_iterator, get_device())
    logits = model(batch["text"], batch["padding_mask"], batch["types"])
    return logits, functools.partial(cross_entropy_loss, batch["label"])


def classifier_terms(config: MegatronConfig, padded_vocab_size: int, *, num_classes: int) -> ModelTerms:
    """BERT's encoder with token types and the pooler, and the task head on each sequence's pooled state."""
    hidden = config.model.hidden_size
    head = (WeightTerm("classification head", hidden * num_classes, 1), WeightTerm("head bias", num_classes))
    return encoder_terms(config, padded_vocab_size, 2, pooler=True) + ModelTerms(head)


# Finetuned checkpoints (`tasks.main --task MNLI|QQP|RACE --save`): trained and scored only by their task, which
# gives `num_classes` to the provider and the terms.
BERT_CLASSIFIER = ModelFamily(
    name="bert_classifier",
    model_class=BertClassifier,
    terms=classifier_terms,
    layouts=Layouts(
        frozenset({"tensor", "sequence"}),
        {"pipeline": "finetuning runs without pipeline parallelism: pass --pipeline-model-parallel-size 1"},
    ),
    pipeline=ENCODER_PIPELINE,
    forward_step=forward_step,
    entry_module="megatron_train.tasks.main",
)


def check_bert_checkpoint(metadata: dict, where: str) -> None:
    """Refuse a checkpoint that holds no BERT encoder (a GPT's, say) before anything is built."""
    kind = saved_family_name(metadata)
    if kind not in (BERT.name, BERT_CLASSIFIER.name):
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
