"""What a loader reads from disk is checked before it builds or allocates anything (docs/architecture.md,
checkpoints): every setting has its field's type and a sane value (sizes positive integers, rates in range), and
the sizes agree with the tensors the files hold (layer count, vocabulary and hidden size from the embedding,
then every tensor's shape against the model the config describes, built on the meta device). A lying
`config.json` or Megatron `args` is an error naming the file, the field and the value, never an allocation of
what the lie implies or a model silently cut to it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

# Integer settings that may be 0; every other integer setting is a size or a count, at least 1.
MAY_BE_ZERO = {"vocab_extra_ids", "tiktoken_num_special_tokens", "iteration"}
# Float settings with a range (inclusive); every float setting must be finite.
FLOAT_RANGES = {
    "hidden_dropout": (0.0, 1.0),
    "attention_dropout": (0.0, 1.0),
    "norm_epsilon": (0.0, math.inf),
    "init_method_std": (0.0, math.inf),
    "rope_scaling_factor": (1e-6, math.inf),
}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _describe(hint: Any) -> str:
    """What a value of type `hint` is, in words (null left out: a present value was given)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args if arg is not type(None))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if hint is type(None):
        return "null"
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object",
             list: "a list"}  # fmt: skip
    return words.get(hint, getattr(hint, "__name__", str(hint)))


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if origin in (list, tuple):
        return isinstance(value, list | tuple) and all(_matches(item, args[0]) for item in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    return True  # a type this check does not model (dicts of a section): the section's own code checks it


def check_fields(
    values: Mapping[str, Any], cls: type, where: str, names: Mapping[str, str] | None = None
) -> None:
    """Each entry of `values` that is a field of the dataclass `cls` has the field's type, and a sane value: an
    integer size at least 1 (0 where `MAY_BE_ZERO`), a float finite and in `FLOAT_RANGES`. `names` maps a field
    to the name the file gives it (config.json's `n_embd` for `hidden_size`); the error names the file (`where`),
    that name and the value."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name not in values:
            continue
        value, label = values[field.name], (names or {}).get(field.name, field.name)
        hint = hints[field.name]
        if not _matches(value, hint):
            raise ValueError(f"{where}: {label} is {_preview(value)}, not {_describe(hint)}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if _matches(0.5, hint):  # a float setting
            low, high = FLOAT_RANGES.get(field.name, (-math.inf, math.inf))
            if not low <= value <= high:
                raise ValueError(f"{where}: {label} is {value}; it must lie in [{low}, {high}]")
        elif value < (minimum := 0 if field.name in MAY_BE_ZERO else 1):
            raise ValueError(f"{where}: {label} is {value}; it must be at least {minimum}")


def check_positive_ints(values: Mapping[str, Any], keys: Iterable[str], where: str) -> None:
    """Each of `keys` in `values` is an integer >= 1 (a size, a count, a parallel size)."""
    for key in keys:
        value = values.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{where}: {key} is {_preview(value)}, not an integer of at least 1")


def describe_type(kind: type) -> str:
    return _describe(kind)


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def layer_count(names: Iterable[str], prefix: str) -> int:
    """How many layers the tensor names under `prefix` (`transformer.h.`, `decoder.layers.`) number; -1 when
    they are not layers 0 .. n-1."""
    found = set()
    for name in names:
        if name.startswith(prefix) and (match := _LAYER_INDEX.match(name, len(prefix) - 1)):
            found.add(int(match.group(1)))
    return len(found) if found == set(range(len(found))) else -1


def check_layers(
    config_layers: int, names: Iterable[str], prefix: str, field: str, where: str, source: str
) -> None:
    """`config_layers` (the file's `field`) against the layers the tensor names of `source` hold."""
    found = layer_count(names, prefix)
    if found != config_layers:
        held = (
            f"{found} layers ({prefix}0 .. {prefix}{found - 1})"
            if found >= 0
            else "layers not numbered 0 .. n-1"
        )
        raise ValueError(f"{where}: {field} is {config_layers}, but there are {held} in {source}")


def check_dims(
    shape: tuple[int, ...], dims: Mapping[int, tuple[str, int]], tensor: str, where: str, source: str
) -> None:
    """The sizes the file's fields give (`dims`: axis -> (field, value)) against one tensor's `shape`."""
    for axis, (field, value) in dims.items():
        if len(shape) <= axis or shape[axis] != value:
            raise ValueError(
                f"{where}: {field} is {value}, but {tensor} in {source} has shape {list(shape)}; the config and "
                "the weights come from different models"
            )


def check_shapes(
    actual: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    sizes: str,
    where: str,
    source: str,
) -> None:
    """Every tensor the config implies (`expected`) is in `actual` with that shape; `sizes` lists the config's
    size fields for the message."""
    for name, shape in expected.items():
        if name not in actual:
            raise ValueError(f"{source}: the weights lack {name!r}, which {where} ({sizes}) needs")
        if tuple(actual[name]) != tuple(shape):
            raise ValueError(
                f"{where}: its sizes ({sizes}) make {name} {list(shape)}, but in {source} it is "
                f"{list(actual[name])}; the config and the weights come from different models"
            )


def check_byte_budget(tensor_bytes: int, file_bytes: int, where: str) -> None:
    """Refuse metadata describing more tensor bytes than the files hold (before anything is allocated)."""
    if tensor_bytes > file_bytes:
        raise ValueError(
            f"{where}: the metadata describes {tensor_bytes} bytes of tensors, but the files hold only "
            f"{file_bytes}; the checkpoint is truncated or its metadata is not its own"
        )
