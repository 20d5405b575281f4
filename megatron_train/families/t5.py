"""The T5 family (Megatron's pretrain_t5): the encoder-decoder `T5Model` on span-corruption samples of
sentence-split WordPiece data (`--encoder-num-layers` / `--decoder-num-layers`, `--encoder-seq-length` /
`--decoder-seq-length`, `--vocab-extra-ids` sentinels), the decoder's LM loss. Tensor, sequence and data
parallelism; no pipeline stages, as Megatron-Core's pretrain_t5."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.data.builder import build_masked_train_valid_test_datasets
from megatron_train.data.t5_dataset import T5DatasetConfig
from megatron_train.device import get_device
from megatron_train.families.family import Layouts, ModelFamily, PipelineSplit
from megatron_train.models.config import TransformerConfig
from megatron_train.models.t5 import T5Model
from megatron_train.models.terms import (
    ModelTerms,
    WeightTerm,
    cross_attention_terms,
    embedding_terms,
    layer_stack_terms,
    output_layer_terms,
)
from megatron_train.parallel.schedules import LossFunc
from megatron_train.tokenizer import MegatronTokenizer
from megatron_train.training.loop import get_batch
from megatron_train.training.per_token_loss import language_model_loss


def forward_step(data_iterator: Iterator, model: torch.nn.Module) -> tuple[torch.Tensor, LossFunc]:
    """Megatron's T5 forward step: per-token decoder LM losses [b, s_dec] and the loss function for them (their
    mean over the decoder tokens, `lm loss`).

    The model takes the encoder's padding mask (`enc_mask`); the decoder is causal, its padding after its
    tokens, where the loss mask is 0."""
    batch = get_batch(data_iterator, get_device())
    output_tensor = model(batch["text_enc"], batch["text_dec"], batch["enc_mask"], lm_labels=batch["labels"])
    return output_tensor, functools.partial(language_model_loss, batch["loss_mask"])


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
    """What pretrain_t5 refuses beyond its layouts, naming the flag."""
    if config.model.decoder_seq_length is None:
        raise ValueError("set --decoder-seq-length (the decoder's input length; Megatron's T5: 128)")


def t5_terms(config: MegatronConfig, padded_vocab_size: int) -> ModelTerms:
    """The shared embedding, the relative position biases, the encoder over --encoder-seq-length tokens, the
    decoder over --decoder-seq-length tokens with cross-attention to the encoder's, and the tied LM head."""
    model = config.model
    encoder_tokens, decoder_tokens = model.seq_length, model.decoder_seq_length
    terms = embedding_terms(model, padded_vocab_size)
    if model.position_embedding_type == "relative":
        biases = 2 * model.relative_attention_num_buckets * model.num_attention_heads
        terms += ModelTerms((WeightTerm("relative position biases", biases),))
    return (
        terms
        + layer_stack_terms("encoder", model, model.num_layers, encoder_tokens, final_norm=not model.post_ln)
        + layer_stack_terms(
            "decoder", model, model.num_decoder_layers, decoder_tokens, final_norm=not model.post_ln
        )
        + cross_attention_terms(
            "decoder", model, model.num_decoder_layers, decoder_tokens, encoder_tokens, encoder_tokens
        )
        + output_layer_terms(model, padded_vocab_size, decoder_tokens, bias=True)
    )


def t5_layer_range(
    model: TransformerConfig, pp_rank: int, pp_size: int, vp_rank: int = 0, vp_size: int | None = None
) -> range:
    """One stage holds both stacks: the layer numbers of the longer of encoder and decoder."""
    return range(max(model.num_layers, model.num_decoder_layers))


_NO_PIPELINE = (
    "T5's encoder and decoder are not split across pipeline stages (Megatron-Core's pretrain_t5 refuses it too); "
    "use --pipeline-model-parallel-size 1 with tensor, sequence and data parallelism"
)

T5 = ModelFamily(
    name="t5",
    model_class=T5Model,
    terms=t5_terms,
    layouts=Layouts(
        frozenset({"tensor", "sequence"}), {"pipeline": _NO_PIPELINE, "virtual pipeline": _NO_PIPELINE}
    ),
    pipeline=PipelineSplit(
        ("embedding.", "encoder_relative_position.", "decoder_relative_position."),
        ("encoder.final_layernorm.", "decoder.final_layernorm.", "output_layer."),
        t5_layer_range,
        ("encoder", "decoder"),
    ),
    forward_step=forward_step,
    datasets_provider=datasets_provider,
    check_config=check_t5_config,
    entry_module="megatron_train.pretrain_t5",
    corpus="sentence",
    finetune_data="--data-path <sentence-split token prefix> [training flags]",
    flow_flags=("--vocab-extra-ids", "100", "--encoder-seq-length", "128", "--decoder-seq-length", "64"),
)
