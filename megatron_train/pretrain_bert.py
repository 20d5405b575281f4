"""Pretrain BERT: `torchrun --nproc-per-node N -m megatron_train.pretrain_bert <Megatron flags>`.

The BERT-specific pieces (model, masked sentence-pair datasets, masked-LM + sentence-order loss) plugged into
the generic loop, as Megatron's pretrain_bert.py. Data: `--split-sentences` output and a WordPiece tokenizer
(`--tokenizer-type BertWordPieceLowerCase --vocab-file ...`); `--bert-no-binary-head` drops the sentence-order
head and loss.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from megatron_train.arguments import MegatronConfig
from megatron_train.data.bert_dataset import BERTDatasetConfig
from megatron_train.data.builder import build_masked_train_valid_test_datasets
from megatron_train.device import get_device
from megatron_train.models.bert import BertModel, bert_model_provider
from megatron_train.parallel.schedules import LossFunc
from megatron_train.tokenizer import MegatronTokenizer
from megatron_train.training.entry import model_build_options, run_pretrain
from megatron_train.training.loop import get_batch


def model_provider(
    config: MegatronConfig,
    padded_vocab_size: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int = 0,
) -> BertModel:
    """This rank's pipeline stage (or its model chunk `vp_stage`) of the BERT model."""
    return bert_model_provider(
        config.model,
        padded_vocab_size,
        pre_process,
        post_process,
        add_binary_head=config.model.bert_binary_head,
        vp_stage=vp_stage,
        **model_build_options(config),
    )


def loss_func(
    loss_mask: torch.Tensor,
    sentence_order: torch.Tensor,
    output_tensor: tuple[torch.Tensor, torch.Tensor | None],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's BERT loss: the masked-LM loss averaged over the masked tokens, plus the sentence-order
    cross entropy when the model has the binary head; both logged (`lm loss`, `sop loss`)."""
    lm_losses, binary_logits = output_tensor
    loss_mask = loss_mask.float()
    lm_loss = (lm_losses.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
    if binary_logits is None:
        return lm_loss, {"lm loss": lm_loss.detach()}
    sop_loss = F.cross_entropy(binary_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1)
    return lm_loss + sop_loss, {"lm loss": lm_loss.detach(), "sop loss": sop_loss.detach()}


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


def main(argv: list[str] | None = None) -> None:
    run_pretrain(
        "pretrain_bert",
        argv,
        model_provider,
        datasets_provider,
        forward_step,
        refuse_per_token_loss_for="BERT",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
