"""Transformer language models (GPT-2 and Llama families as configurations of one GPTModel)."""

from megatron_train.models.config import TransformerConfig
from megatron_train.models.gpt import GPTModel
from megatron_train.models.kv_cache import KVCache

__all__ = ["GPTModel", "KVCache", "TransformerConfig"]
