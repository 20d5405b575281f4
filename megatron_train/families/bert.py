"""The BERT family (Megatron's pretrain_bert): `BertModel` on masked sentence-pair samples of sentence-split
WordPiece data, the masked-LM loss plus the sentence-order loss of the binary head (`--bert-no-binary-head` drops
both)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from megatron_train.arguments import MegatronConfig
from megatron_train.data.bert_dataset import BERTDatasetConfig
from megatron_train.data.builder import build_masked_train_valid_test_datasets
from megatron_train.device import get_device
from megatron_train.families.family import (
    DENSE_DIMENSIONS,
    HFConversion,
    Layouts,
    MegatronNames,
    ModelFamily,
    PipelineSplit,
)
from megatron_train.models.bert import BertModel
from megatron_train.models.hf_bert import export_bert
from megatron_train.models.terms import (
    ModelTerms,
    WeightTerm,
    embedding_terms,
    layer_stack_terms,
    norm_parameters,
    output_layer_terms,
)
from megatron_train.parallel.schedules import LossFunc
from megatron_train.tokenizer import MegatronTokenizer
from megatron_train.training.loop import get_batch
from megatron_train.training.per_token_loss import language_model_loss

# The encoder's stages: the embedding on the first; the final norm, LM head, pooler and binary head on the last
# (a finetuned classifier's head too: `tasks.finetune`).
ENCODER_PIPELINE = PipelineSplit(
    ("embedding.",),
    (
        "encoder.final_layernorm.",
        "output_layer.",
        "lm_head.",
        "pooler.",
        "binary_head.",
        "classification_head.",
    ),
    layer_stacks=("encoder",),
)


def bert_model_options(config: MegatronConfig) -> dict[str, bool]:
    """The binary head unless --bert-no-binary-head (token types only with it, as Megatron's pretrain_bert)."""
    return {"add_binary_head": config.model.bert_binary_head}


def loss_func(
    loss_mask: torch.Tensor,
    sentence_order: torch.Tensor,
    output_tensor: tuple[torch.Tensor, torch.Tensor | None],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's BERT loss: the masked-LM loss averaged over the masked tokens, plus the sentence-order
    cross entropy when the model has the binary head; both logged (`lm loss`, `sop loss`)."""
    lm_losses, binary_logits = output_tensor
    lm_loss, logged = language_model_loss(loss_mask, lm_losses)
    if binary_logits is None:
        return lm_loss, logged
    sop_loss = F.cross_entropy(binary_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1)
    return lm_loss + sop_loss, {**logged, "sop loss": sop_loss.detach()}


def forward_step(data_iterator: Iterator, model: torch.nn.Module) -> tuple[torch.Tensor, LossFunc]:
    """Megatron's BERT forward step: (per-token LM losses [b, s], binary logits [b, 2] or None) on the last
    pipeline stage (hidden states [s, b, h] elsewhere), and the loss function for them."""
    batch = get_batch(data_iterator, get_device())
    output_tensor = model(batch["text"], batch["padding_mask"], batch["types"], lm_labels=batch["labels"])
    return output_tensor, functools.partial(loss_func, batch["loss_mask"], batch["is_random"])


def datasets_provider(
    config: MegatronConfig, tokenizer: MegatronTokenizer, num_samples: tuple[int, int, int]
) -> tuple:
    dataset_config = BERTDatasetConfig(
        seq_length=config.model.seq_length,
        seed=config.training.seed,
        tokenizer=tokenizer,
        masking_probability=config.data.mask_prob,
        short_sequence_probability=config.data.short_seq_prob,
        classification_head=config.model.bert_binary_head,
    )
    return build_masked_train_valid_test_datasets(config.data, dataset_config, num_samples)


def encoder_terms(
    config: MegatronConfig, padded_vocab_size: int, num_tokentypes: int, pooler: bool
) -> ModelTerms:
    """A BERT encoder: embeddings (with `num_tokentypes` token types), the layers over --seq-length tokens, the
    final norm (pre-LN), and the pooler on the [CLS] token when it has one."""
    model, seq, hidden = config.model, config.model.seq_length, config.model.hidden_size
    terms = embedding_terms(model, padded_vocab_size, num_tokentypes) + layer_stack_terms(
        "encoder", model, model.num_layers, seq, final_norm=not model.post_ln
    )
    if pooler:
        terms += ModelTerms((WeightTerm("pooler", hidden * hidden, 1), WeightTerm("pooler bias", hidden)))
    return terms


def bert_terms(config: MegatronConfig, padded_vocab_size: int) -> ModelTerms:
    """The encoder, the LM head (dense, norm, the tied output layer and its bias) over every position, as
    Megatron counts it, and the binary head."""
    model, seq, hidden = config.model, config.model.seq_length, config.model.hidden_size
    binary_head = model.bert_binary_head
    lm_head = ModelTerms(
        (
            WeightTerm("LM head", hidden * hidden, seq),
            WeightTerm("LM head bias and norm", hidden + norm_parameters(model)),
        )
    )
    terms = (
        encoder_terms(config, padded_vocab_size, 2 if binary_head else 0, pooler=binary_head)
        + lm_head
        + output_layer_terms(model, padded_vocab_size, seq, bias=True)
    )
    if binary_head:
        terms += ModelTerms((WeightTerm("binary head", 2 * hidden, 1), WeightTerm("binary head bias", 2)))
    return terms


BERT = ModelFamily(
    name="bert",
    model_class=BertModel,
    model_options=bert_model_options,
    terms=bert_terms,
    layouts=Layouts(
        DENSE_DIMENSIONS - {"context"},
        {
            "context": "BERT's attention is bidirectional over padding, and context parallelism splits causal "
            "attention only (Megatron's pretrain_bert has none either); use tensor and sequence parallelism"
        },
    ),
    pipeline=ENCODER_PIPELINE,
    forward_step=forward_step,
    datasets_provider=datasets_provider,
    entry_module="megatron_train.pretrain_bert",
    corpus="sentence",
    finetune_data="--data-path <sentence-split token prefix> [training flags]",
    megatron_names=MegatronNames("encoder"),
    hf=HFConversion(
        ("bert",),
        export_bert,
        "AutoModelForPreTraining",
    ),
)
