"""Command-line flags generated from config dataclasses: one flag per field (`num_layers` is `--num-layers`,
`metadata["flag"]` overrides the name, a bool defaulting to True gets `--no-<name>`); see docs/architecture.md,
"Configuration and flags". No torch here: tools that need only some flags (the tokenize command line) parse them
without importing the training engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal


def flag_name(f: dataclasses.Field) -> str:
    """The command-line flag of a config field."""
    if "flag" in f.metadata:
        return f.metadata["flag"]
    prefix = "--no-" if f.default is True else "--"
    return prefix + f.name.replace("_", "-")


def is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _argument_kwargs(f: dataclasses.Field, annotation: Any) -> dict[str, Any]:
    kind = _strip_optional(annotation)
    kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata.get("help")}
    if kind is bool:
        kwargs["action"] = "store_false" if f.default is True else "store_true"
        return kwargs
    if typing.get_origin(kind) is list:
        (kwargs["type"],) = typing.get_args(kind)
        kwargs["nargs"] = f.metadata.get("nargs", "+")
    elif typing.get_origin(kind) is Literal:
        kwargs["choices"] = typing.get_args(kind)
        kwargs["type"] = type(kwargs["choices"][0])
    else:
        kwargs["type"] = kind
    kwargs["required"] = is_required(f)
    return kwargs


def add_config_arguments(group: argparse._ActionsContainer, cls: type, seen: set[str] | None = None) -> None:
    """One flag per field of the config dataclass `cls`, skipping (and extending) `seen`; a flag given is
    set in the namespace under the field's name, one not given is absent."""
    seen = set() if seen is None else seen
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in seen:
            continue
        seen.add(f.name)
        group.add_argument(flag_name(f), **_argument_kwargs(f, hints[f.name]))
        if "opposite_flag" in f.metadata:  # a boolean's explicit other setting (--bert-binary-head)
            group.add_argument(
                f.metadata["opposite_flag"],
                dest=f.name,
                action="store_const",
                const=f.default,
                default=argparse.SUPPRESS,
                help=f"The opposite of {flag_name(f)}.",
            )
