"""Every stage by name: what flows look a stage up in (docs/architecture.md, "The stage contract").

A stage's module is imported on first look-up, so the corpus stages are found without importing torch (which
the pretrain and evaluate stages need): a command line with nothing to do stays quick.
"""

from __future__ import annotations

import importlib

from stages.base import Stage

STAGE_MODULES: dict[str, str] = {
    name: f"stages.{name}"
    for name in ("download", "clean", "dedup", "train_tokenizer", "tokenize", "pretrain", "evaluate")
} | {
    name: f"stages.{name}"
    for name in (
        "retro_embedder",
        "retro_db",
        "retro_embed",
        "retro_index_train",
        "retro_index_add",
        "retro_query",
    )
}


def stage_named(name: str) -> Stage:
    """The stage called `name`, from its module's `STAGE`."""
    if name not in STAGE_MODULES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGE_MODULES)}")
    return importlib.import_module(STAGE_MODULES[name]).STAGE
