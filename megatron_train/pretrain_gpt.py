"""Pretrain a GPT/Llama model: `torchrun --nproc-per-node N -m megatron_train.pretrain_gpt <Megatron flags>`.

The GPT-specific pieces (model, datasets, loss) plugged into the generic loop, as Megatron's pretrain_gpt.py.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator

import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.data.builder import build_train_valid_test_datasets
from megatron_train.data.sft_dataset import build_sft_datasets
from megatron_train.device import get_device
from megatron_train.models.gpt import GPTModel, model_provider
from megatron_train.parallel.schedules import LossFunc
from megatron_train.tokenizer import MegatronTokenizer
from megatron_train.training.entry import model_build_options, run_pretrain
from megatron_train.training.loop import get_batch
from megatron_train.training.per_token_loss import NUM_TOKENS_KEY


def gpt_model_provider(
    config: MegatronConfig,
    padded_vocab_size: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int = 0,
) -> GPTModel:
    """This rank's pipeline stage (or its model chunk `vp_stage`) of the GPT model."""
    return model_provider(
        config.model,
        padded_vocab_size,
        pre_process,
        post_process,
        vp_stage=vp_stage,
        **model_build_options(config),
    )


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor, per_token_loss: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean next-token loss over the micro-batch's unmasked tokens (Megatron's GPT loss_func); with
    `per_token_loss` (--calculate-per-token-loss) the loss sum and the token count, for the loop to divide."""
    loss_mask = loss_mask.float()
    loss_sum = (output_tensor.float() * loss_mask).sum()
    if per_token_loss:
        return loss_sum, {"lm loss": loss_sum.detach(), NUM_TOKENS_KEY: loss_mask.sum()}
    loss = loss_sum / loss_mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach()}


def forward_step(
    data_iterator: Iterator, model: torch.nn.Module, per_token_loss: bool = False
) -> tuple[torch.Tensor, LossFunc]:
    """Megatron's GPT forward step: per-token losses [b, s] on the last pipeline stage (hidden states
    [s, b, h] elsewhere, the input coming from the previous stage), and the loss function for them."""
    batch = get_batch(data_iterator, get_device())
    output_tensor = model(
        batch["tokens"], batch["position_ids"], labels=batch["labels"], document_ids=batch.get("document_ids")
    )
    return output_tensor, functools.partial(loss_func, batch["loss_mask"], per_token_loss=per_token_loss)


def datasets_provider(
    config: MegatronConfig, tokenizer: MegatronTokenizer, num_samples: tuple[int, int, int]
) -> tuple:
    if config.data.sft:
        return build_sft_datasets(
            config.data, tokenizer, config.model.seq_length, num_samples, config.training.seed
        )
    return build_train_valid_test_datasets(
        config.data,
        config.model.seq_length,
        num_samples,
        config.training.seed,
        tokenizer.eod,
        vocab_size=tokenizer.vocab_size,
    )


def main(argv: list[str] | None = None) -> None:
    run_pretrain("pretrain_gpt", argv, gpt_model_provider, datasets_provider, forward_step)


if __name__ == "__main__":
    main(sys.argv[1:])
