"""The GPT family: GPT-2, Llama, Mistral and Qwen2 as configurations of one `GPTModel` (Megatron's pretrain_gpt).

Its model provider, forward step and datasets (Megatron's GPTDataset, or SFT conversations with --sft), its
terms, its pipeline split, its names in Megatron-LM checkpoints and its Hugging Face architectures.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from megatron_train.arguments import MegatronConfig
from megatron_train.data.builder import build_train_valid_test_datasets
from megatron_train.data.sft_dataset import build_sft_datasets
from megatron_train.device import get_device
from megatron_train.families.family import (
    ALL_DIMENSIONS,
    HFConversion,
    InferenceHooks,
    Layouts,
    MegatronNames,
    ModelFamily,
    PipelineSplit,
)
from megatron_train.models.gpt import GPTModel
from megatron_train.models.hf_gpt import (
    LLAMA_TYPES,
    MOE_TYPES,
    export_gpt,
)
from megatron_train.models.terms import ModelTerms, embedding_terms, layer_stack_terms, output_layer_terms
from megatron_train.parallel.context_parallel import slice_batch
from megatron_train.parallel.schedules import LossFunc
from megatron_train.parallel.state import process_groups
from megatron_train.tokenizer import MegatronTokenizer
from megatron_train.training.loop import get_batch
from megatron_train.training.per_token_loss import language_model_loss

# A decoder-only model's stages: the embedding on the first, the final norm and output layer on the last.
DECODER_PIPELINE = PipelineSplit(("embedding.",), ("decoder.final_layernorm.", "output_layer."))


def forward_step(
    data_iterator: Iterator,
    model: torch.nn.Module,
    per_token_loss: bool = False,
    inputs: tuple[str, ...] = ("document_ids",),
) -> tuple[torch.Tensor, LossFunc]:
    """Megatron's GPT forward step: per-token losses [b, s] on the last pipeline stage (hidden states [s, b, h]
    elsewhere, the input coming from the previous stage), and the loss function for them. `inputs`: the batch's
    optional entries the model takes when present (--reset-attention-mask and packed SFT's document ids). Under
    context parallelism each rank takes its chunks of the sequence and the loss is the whole sequence's."""
    cp_group = process_groups().cp
    batch = slice_batch(get_batch(data_iterator, get_device()), cp_group)
    extra = {key: batch[key] for key in inputs if key in batch}
    output_tensor = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], **extra)
    return output_tensor, functools.partial(
        language_model_loss, batch["loss_mask"], per_token_loss=per_token_loss, cp_group=cp_group
    )


def datasets_provider(
    config: MegatronConfig, tokenizer: MegatronTokenizer, num_samples: tuple[int, int, int]
) -> tuple:
    """GPTDataset splits of --data-path (or the mock data), or with --sft the SFT conversations."""
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


def gpt_terms(config: MegatronConfig, padded_vocab_size: int) -> ModelTerms:
    """Embeddings, the decoder layers over --seq-length tokens, the final norm and the output layer."""
    model, seq = config.model, config.model.seq_length
    return (
        embedding_terms(model, padded_vocab_size)
        + layer_stack_terms("decoder", model, model.num_layers, seq, final_norm=not model.post_ln)
        + output_layer_terms(model, padded_vocab_size, seq)
    )


GPT = ModelFamily(
    name="gpt",
    model_class=GPTModel,
    terms=gpt_terms,
    layouts=Layouts(ALL_DIMENSIONS),
    pipeline=DECODER_PIPELINE,
    forward_step=forward_step,
    datasets_provider=datasets_provider,
    per_token_loss=True,
    mixture_of_experts=True,
    entry_module="megatron_train.pretrain_gpt",
    corpus="document",
    finetune_data="--sft --train-data-path <conversations.jsonl> [training flags] (or, for more pretraining, "
    "--data-path <token prefix> without --sft)",
    megatron_names=MegatronNames("decoder"),
    hf=HFConversion(
        ("gpt2", *LLAMA_TYPES, *MOE_TYPES),
        export_gpt,
        "AutoModelForCausalLM",
    ),
    inference=InferenceHooks(),
)
