"""Pretrain T5: `torchrun --nproc-per-node N -m megatron_train.pretrain_t5 <Megatron flags>`.

The T5 pieces (encoder-decoder model, span-corruption datasets, decoder LM loss) plugged into the generic
loop, as Megatron's pretrain_t5.py: `--encoder-num-layers` / `--decoder-num-layers`, `--encoder-seq-length` /
`--decoder-seq-length`, `--vocab-extra-ids` sentinels, `--split-sentences` data and a WordPiece tokenizer.
Tensor, sequence and data parallelism, the distributed optimizer, bf16/fp16 and recompute apply; pipeline
parallelism is refused, as Megatron-Core's pretrain_t5 does.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator

import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.data.builder import build_masked_train_valid_test_datasets
from megatron_train.data.t5_dataset import T5DatasetConfig
from megatron_train.device import get_device
from megatron_train.models.t5 import T5Model
from megatron_train.parallel.schedules import LossFunc
from megatron_train.pretrain_gpt import loss_func
from megatron_train.tokenizer import MegatronTokenizer
from megatron_train.training.entry import model_build_options, run_pretrain
from megatron_train.training.loop import get_batch


def model_provider(
    config: MegatronConfig,
    padded_vocab_size: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int = 0,
) -> T5Model:
    """The whole T5 model on every rank (no pipeline stages, so `vp_stage` is always 0)."""
    return T5Model(
        config.model,
        padded_vocab_size,
        pre_process,
        post_process,
        **model_build_options(config),
    )


def forward_step(data_iterator: Iterator, model: torch.nn.Module) -> tuple[torch.Tensor, LossFunc]:
    """Megatron's T5 forward step: per-token decoder LM losses [b, s_dec] and the loss function for them (GPT's:
    their mean over the decoder tokens, `lm loss`).

    The model takes the encoder's padding mask (`enc_mask`); the decoder is causal, its padding after its
    tokens, where the loss mask is 0."""
    batch = get_batch(data_iterator, get_device())
    output_tensor = model(batch["text_enc"], batch["text_dec"], batch["enc_mask"], lm_labels=batch["labels"])
    return output_tensor, functools.partial(loss_func, batch["loss_mask"])


def datasets_provider(
    config: MegatronConfig, tokenizer: MegatronTokenizer, num_samples: tuple[int, int, int]
) -> tuple:
    dataset_config = T5DatasetConfig(
        seq_length=config.model.seq_length,
        decoder_seq_length=config.model.decoder_seq_length,
        seed=config.training.seed,
        tokenizer=tokenizer,
        masking_probability=config.data.mask_prob,
        short_sequence_probability=config.data.short_seq_prob,
    )
    return build_masked_train_valid_test_datasets(config.data, dataset_config, num_samples)


def check_t5_config(config: MegatronConfig) -> None:
    """What pretrain_t5 refuses before starting, naming the flag."""
    if config.parallel.pipeline_model_parallel_size > 1:
        raise SystemExit(
            f"pretrain_t5: --pipeline-model-parallel-size {config.parallel.pipeline_model_parallel_size}: T5's "
            "encoder and decoder are not split across pipeline stages (Megatron-Core's pretrain_t5 refuses it "
            "too); use --pipeline-model-parallel-size 1 with tensor, sequence and data parallelism"
        )
    if config.model.decoder_seq_length is None:
        raise SystemExit(
            "pretrain_t5: set --decoder-seq-length (the decoder's input length; Megatron's T5: 128)"
        )


def main(argv: list[str] | None = None) -> None:
    run_pretrain(
        "pretrain_t5",
        argv,
        model_provider,
        datasets_provider,
        forward_step,
        refuse_per_token_loss_for="T5",
        check_config=check_t5_config,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
