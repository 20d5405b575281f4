"""Tokenizers for Megatron's `--tokenizer-type` values, and tokenizer training (`megatron_train.tokenizer.train`)."""

from megatron_train.tokenizer.base import MegatronTokenizer
from megatron_train.tokenizer.build import (
    TOKENIZER_TYPES,
    build_tokenizer,
    tokenizer_from_config,
    vocab_size_with_padding,
)

__all__ = [
    "TOKENIZER_TYPES",
    "MegatronTokenizer",
    "build_tokenizer",
    "tokenizer_from_config",
    "vocab_size_with_padding",
]
