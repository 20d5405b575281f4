"""Model families by name: the project's own, and a family defined anywhere else named `pkg.module:ATTR`
(`--model-family`), looked up the same way (docs/architecture.md, model families).

A family module is imported when a run, a checkpoint or a tool first asks for it, never before: the registry
itself imports no family, so any module may look families up (a checkpoint loader, the converter) without
importing what the families import. A checkpoint records its family's name (`model_type`) and, for a family
from outside the project, the `pkg.module:ATTR` it came from (`model_family`). Importing that module runs its
code, so a loader imports it only when the user names it with `--model-family` too: nothing in a checkpoint
runs code.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator
from typing import Any

from megatron_train.families.family import ModelFamily

# The project's families: name -> where the record lives (the Retro family lives beside its preprocessing).
BUILTIN_FAMILIES = {
    "gpt": "megatron_train.families.gpt:GPT",
    "bert": "megatron_train.families.bert:BERT",
    "bert_classifier": "megatron_train.tasks.finetune.model:BERT_CLASSIFIER",
    "t5": "megatron_train.families.t5:T5",
    "hybrid": "megatron_train.families.hybrid:HYBRID",
    "retro": "retro.family:RETRO",
}
# A checkpoint without a family record was written before it existed, when every checkpoint was GPT's.
DEFAULT_FAMILY = "gpt"


def get_family(name: str) -> ModelFamily:
    """The family `name`: a project family's name (`gpt`), or `pkg.module:ATTR` naming a ModelFamily defined
    anywhere importable. Anything else is a ValueError naming what would work."""
    spec = BUILTIN_FAMILIES.get(name, name)
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(
            f"model family {name!r} is neither one of this project's ({', '.join(BUILTIN_FAMILIES)}) nor "
            "`pkg.module:ATTR` naming a ModelFamily"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"model family {name}: cannot import {module_name} ({error}); put its package on PYTHONPATH (every "
            "torchrun worker imports it too)"
        ) from error
    family = getattr(module, attribute, None)
    if not isinstance(family, ModelFamily):
        raise ValueError(
            f"model family {name}: {module_name}.{attribute} is a {type(family).__name__}, not a "
            "megatron_train.families.family.ModelFamily"
        )
    return family


def family_module(name: str) -> str:
    """The module that defines the family `name` (a project family's name or `pkg.module:ATTR`): its code is what
    a run of the family executes beside the entry point's (stage keys cover it: `stages.pretrain`)."""
    return BUILTIN_FAMILIES.get(name, name).partition(":")[0]


def named_family(argv: list[str]) -> str | None:
    """`--model-family` of a command line, read before its parser is built (the family may add flags to it)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model-family")
    return parser.parse_known_args(argv)[0].model_family


def is_builtin(name: str) -> bool:
    return name in BUILTIN_FAMILIES


def builtin_families() -> Iterator[ModelFamily]:
    for name in BUILTIN_FAMILIES:
        yield get_family(name)


def checkpoint_record(name: str, model_family: str | None) -> dict[str, Any]:
    """What metadata.json records of the family `name`: the name, and for a family from outside the project the
    `--model-family` that named it."""
    record: dict[str, Any] = {"model_type": name}
    if model_family is not None and not is_builtin(model_family):
        record["model_family"] = model_family
    return record


def saved_family_name(metadata: dict) -> str:
    """The family name a checkpoint records; checkpoints from before the record are GPT's."""
    return metadata.get("model_type", DEFAULT_FAMILY)


def trained_by(metadata: dict) -> str:
    """The entry point that trains the family a checkpoint records, for errors (`pretrain_gpt`)."""
    recorded = metadata.get("model_family")
    if recorded is not None:
        return f"pretrain --model-family {recorded}"
    return get_family(saved_family_name(metadata)).entry


def checkpoint_family(metadata: dict, model_family: str | None, where: str) -> ModelFamily:
    """The family of the checkpoint in `where` (its metadata), checked against `--model-family` when given.

    A family from outside the project is imported only when `--model-family` names it (see the module's
    docstring); a `--model-family` naming another family than the checkpoint's is refused."""
    recorded = metadata.get("model_family")
    name = saved_family_name(metadata)
    if recorded is not None and model_family != recorded:
        raise ValueError(
            f"checkpoint {where} holds a {name} model of the family {recorded}, defined outside this project; "
            f"loading it imports and runs that module: pass --model-family {recorded} to do so"
        )
    family = get_family(recorded or name)
    if model_family is not None and get_family(model_family).name != family.name:
        raise ValueError(
            f"--model-family {model_family}, but checkpoint {where} holds a {family.name} model: drop the flag "
            "or load a checkpoint of that family"
        )
    return family


def hf_family(model_type: Any, where: str, model_family: str | None) -> ModelFamily:
    """The family (the project's, or the one `model_family` names) whose Hugging Face architectures include
    config.json `where`'s `model_type`."""
    families = list(builtin_families())
    if model_family is not None and not is_builtin(model_family):
        families.append(get_family(model_family))
    mapped = {
        architecture: family
        for family in families
        if family.hf is not None
        for architecture in family.hf.architectures
    }
    if model_type not in mapped:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not one the hf loader maps (it maps "
            f"{', '.join(sorted(mapped))}); convert the model from one of those architectures"
        )
    return mapped[model_type]
