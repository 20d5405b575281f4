"""docs/architecture.md stays true to the code: every dotted name of the project it quotes (`stages.registry.
stage_named`, `training.entry.run_pretrain`, ...) is a module, or an attribute of one, that exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron_train", "stages", "flows", "retro", "storage")
# megatron_train's subpackages and top modules, which the document names relative to it (`models.gpt.GPTModel`)
ENGINE = tuple(
    path.stem
    for path in (ROOT / "megatron_train").iterdir()
    if path.suffix == ".py" or (path / "__init__.py").exists()
)
# a dotted name right after a backtick, ending where a name ends (not `optimizer.state.<name>`, a key pattern)
QUOTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?=[`(\[ ,:])")
# `arguments.py`, `tokenizer.json`: file names, not modules and attributes
FILE_SUFFIXES = (
    "py",
    "json",
    "jsonl",
    "txt",
    "md",
    "bin",
    "idx",
    "pt",
    "safetensors",
    "npy",
    "parquet",
    "yaml",
)


def resolves(name: str) -> bool:
    """Whether `name` is an importable module followed by attributes it has."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def project_names(text: str) -> set[str]:
    """The dotted names quoted in `text` that start with a project package or a module of the engine."""
    names = set()
    for name in QUOTED.findall(text):
        head, last = name.split(".")[0], name.rsplit(".", 1)[1]
        if last in FILE_SUFFIXES:
            continue
        if head in PACKAGES:
            names.add(name)
        elif head in ENGINE and head != "__init__":
            names.add(f"megatron_train.{name}")
    return names


def test_every_project_name_in_the_architecture_document_resolves():
    names = project_names((ROOT / "docs" / "architecture.md").read_text())
    assert len(names) > 60  # the document names the code throughout
    assert sorted(name for name in names if not resolves(name)) == []
