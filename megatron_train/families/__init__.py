"""Model families: one `ModelFamily` record per family (GPT, BERT, T5, Retro, and any registered from outside the
project), looked up by name in `registry`. See docs/architecture.md (model families)."""

from megatron_train.families.family import ModelFamily
from megatron_train.families.registry import checkpoint_family, get_family

__all__ = ["ModelFamily", "checkpoint_family", "get_family"]
