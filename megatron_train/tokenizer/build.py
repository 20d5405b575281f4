"""`build_tokenizer`: Megatron's `--tokenizer-type` names and flags to a tokenizer; vocabulary padding."""

from __future__ import annotations

from megatron_train.tokenizer.base import MegatronTokenizer, require_file
from megatron_train.tokenizer.bert import BertWordPieceTokenizer
from megatron_train.tokenizer.gpt2 import GPT2BPETokenizer
from megatron_train.tokenizer.huggingface import load_huggingface_tokenizer
from megatron_train.tokenizer.null import NullTokenizer
from megatron_train.tokenizer.sentencepiece_model import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megatron_train.tokenizer.tiktoken_bpe import TikTokenizer
from megatron_train.training.config import TokenizerConfig

TOKENIZER_TYPES: tuple[str, ...] = (
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
    "TikTokenizer",
)
# The types that take `--vocab-extra-ids` (T5 sentinels); the others have no room for them.
_EXTRA_IDS_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer")


def build_tokenizer(
    tokenizer_type: str,
    *,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    vocab_extra_ids: int = 0,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
) -> MegatronTokenizer:
    """The tokenizer Megatron builds for `--tokenizer-type` and its flags (--vocab-file, --merge-file,
    --tokenizer-model, --vocab-size, --vocab-extra-ids, --tiktoken-pattern, --tiktoken-num-special-tokens)."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"unknown --tokenizer-type {tokenizer_type!r}; choose one of: {', '.join(TOKENIZER_TYPES)}"
        )
    if vocab_extra_ids and tokenizer_type not in _EXTRA_IDS_TYPES:
        raise ValueError(
            f"--vocab-extra-ids is only supported by {', '.join(_EXTRA_IDS_TYPES)}, not {tokenizer_type}"
        )
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            require_file(vocab_file, "--vocab-file", tokenizer_type),
            require_file(merge_file, "--merge-file", tokenizer_type),
        )
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(
            require_file(vocab_file, "--vocab-file", tokenizer_type),
            lower_case=tokenizer_type == "BertWordPieceLowerCase",
            vocab_extra_ids=vocab_extra_ids,
        )
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError(
                "HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json file or a local folder)"
            )
        return load_huggingface_tokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    model_file = require_file(tokenizer_model, "--tokenizer-model", tokenizer_type)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(model_file, tiktoken_pattern, vocab_size, tiktoken_num_special_tokens)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(model_file, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(model_file)
    return Llama2Tokenizer(model_file)


def tokenizer_from_config(config: TokenizerConfig) -> MegatronTokenizer:
    """The tokenizer of Megatron's tokenizer flags, for every entry point. Without --tokenizer-type,
    `--vocab-file` + `--merge-file` mean GPT2BPETokenizer (as Megatron's GPT-3 example relies on), a `--vocab-file`
    alone BertWordPieceLowerCase (the default of Megatron's pretrain_bert and pretrain_t5, which its README's
    and example scripts' BERT and T5 commands rely on) and a bare `--vocab-size N` NullTokenizer (handy with
    --mock-data)."""
    tokenizer_type = config.tokenizer_type
    if tokenizer_type is None and config.vocab_file and config.merge_file:
        tokenizer_type = "GPT2BPETokenizer"
    elif tokenizer_type is None and config.vocab_file:
        tokenizer_type = "BertWordPieceLowerCase"
    elif tokenizer_type is None and config.vocab_size:
        tokenizer_type = "NullTokenizer"
    if tokenizer_type is None:
        raise ValueError(
            "no tokenizer: set --tokenizer-type (with its --vocab-file/--merge-file/--tokenizer-model) or "
            "--vocab-size"
        )
    return build_tokenizer(
        tokenizer_type,
        vocab_file=config.vocab_file,
        merge_file=config.merge_file,
        tokenizer_model=config.tokenizer_model,
        vocab_size=config.vocab_size,
        vocab_extra_ids=config.vocab_extra_ids,
        tiktoken_pattern=config.tiktoken_pattern,
        tiktoken_num_special_tokens=config.tiktoken_num_special_tokens,
    )


def vocab_size_with_padding(
    orig_vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Megatron's padded vocabulary: the next multiple of divisible_by * TP, so each tensor-parallel rank
    holds an equal, GPU-friendly slice of the embedding."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    if multiple < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by ({make_vocab_size_divisible_by}) and --tensor-model-parallel-size "
            f"({tensor_model_parallel_size}) must be positive"
        )
    return -(-orig_vocab_size // multiple) * multiple
