"""Every stage by name: what flows look a stage up in (docs/architecture.md, "The stage contract").

A stage's module is imported on first look-up, so the corpus stages are found without importing torch (which
the pretrain and evaluate stages need): a command line with nothing to do stays quick.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any

from stages.base import Stage
from storage.artifacts import ArtifactRef, ArtifactStore

STAGE_MODULES: dict[str, str] = {
    name: f"stages.{name}"
    for name in (
        "download",
        "clean",
        "dedup",
        "train_tokenizer",
        "tokenize",
        "pretrain",
        "evaluate",
        "convert",
        "retro_embedder",
        "retro_db",
        "retro_embed",
        "retro_index_train",
        "retro_index_add",
        "retro_query",
        "retro_pretrain",
        "retro_evaluate",
    )
}


def stage_named(name: str) -> Stage:
    """The stage called `name`, from its module's `STAGE`."""
    if name not in STAGE_MODULES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGE_MODULES)}")
    return importlib.import_module(STAGE_MODULES[name]).STAGE


def input_refs(store: ArtifactStore, inputs: Sequence[dict | str]) -> list[ArtifactRef | str]:
    """A stage's inputs as flows pass them (artifact references as plain dicts, source fingerprints as strings)
    as the stage takes them."""
    return [store.ref(i) if isinstance(i, dict) else i for i in inputs]


def committed_ref(
    stage: str, params: dict[str, Any], inputs: Sequence[dict | str], store: ArtifactStore
) -> tuple[str, dict[str, Any] | None]:
    """(the stage's key for these params and inputs, what a run would find in `store` under its cache policy as a
    cache-hit ref, or None), decided from the store alone: nothing runs, no Prefect server is needed."""
    runner = stage_named(stage)
    typed, refs = runner.params_from_dict(params), input_refs(store, inputs)
    key, base_key = runner.keys(typed, refs)
    found = store.lookup(runner.name, key, base_key)
    if found is None:
        return key, None
    return found.key, dataclasses.replace(found, cache_hit=True).to_dict()
