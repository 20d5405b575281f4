"""Command lines for flows: every field of a flow's typed config becomes a flag.

A field `min_words` of the config's `clean` section is `--clean.min-words`; top-level fields are plain
(`--store`). Values parse by the field's type; `None` clears an optional field (switches a filter off). A list
of strings takes one or more words, each a JSON list or comma-separated values: `--clean.languages en,de`,
`--clean.url-blocklist a.txt b.txt` and `--tokenize.json-keys '["text", "title"]'` all work (top-level fields too:
`--rebuild clean,tokenize`). A bool flag given alone means true (`--reuse-across-code-changes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

Config = TypeVar("Config", bound=BaseModel)


def _flag(prefix: str, name: str) -> str:
    return "--" + (f"{prefix.replace('_', '-')}." if prefix else "") + name.replace("_", "-")


def _parser_for(annotation: Any) -> Any:
    """A function from the command-line string to a value of `annotation`."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        inner = _parser_for(args[0]) if len(args) == 1 else json.loads
        return lambda text: None if text in ("None", "none", "null") else inner(text)
    if annotation is bool:
        return _parse_bool
    if annotation in (int, float, str):
        return annotation
    if origin is typing.Literal:
        return str
    return json.loads  # lists, tuples, dicts: JSON on the command line


def _is_string_list(annotation: Any) -> bool:
    """list[str], tuple[str, ...] (optional or not)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return len(args) == 1 and _is_string_list(args[0])
    return typing.get_origin(annotation) in (list, tuple) and set(args) <= {str, Ellipsis} and bool(args)


class _StringList(argparse.Action):
    """One or more words, each a JSON list or comma-separated values, as one list; `None` alone clears it."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values in (["None"], ["none"], ["null"]):
            setattr(namespace, self.dest, None)
            return
        items: list[str] = []
        for word in values:
            try:
                parsed = json.loads(word) if word.lstrip().startswith("[") else None
            except json.JSONDecodeError as error:
                parser.error(f"{option_string}: {word!r} is not a JSON list ({error.msg})")
            items += parsed if isinstance(parsed, list) else [item for item in word.split(",") if item]
        setattr(namespace, self.dest, items)


def _value_kind(annotation: Any) -> dict[str, Any]:
    """How argparse reads a field's value: a list of strings in one or more words, a bool that may stand alone
    (true), or one value parsed by its type."""
    if _is_string_list(annotation):
        return {"nargs": "+", "action": _StringList}
    if annotation is bool:
        return {"nargs": "?", "const": True, "type": _parse_bool}
    return {"type": _parser_for(annotation)}


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _fields(section: Any) -> list[tuple[str, Any, Any]]:
    """(name, annotation, default) of a pydantic model or dataclass type."""
    if isinstance(section, type) and issubclass(section, BaseModel):
        return [
            (n, f.annotation, f.get_default(call_default_factory=True))
            for n, f in section.model_fields.items()
        ]
    hints = typing.get_type_hints(section)
    out = []
    for f in dataclasses.fields(section):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append((f.name, hints[f.name], default))
    return out


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and (
        dataclasses.is_dataclass(annotation) or issubclass(annotation, BaseModel)
    )


def build_parser(config_cls: type[BaseModel], description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name, annotation, default in _fields(config_cls):
        if _is_section(annotation):
            group = parser.add_argument_group(name)
            for sub, sub_ann, sub_default in _fields(annotation):
                group.add_argument(
                    _flag(name, sub),
                    dest=f"{name}.{sub}",
                    default=argparse.SUPPRESS,
                    help=f"(default: {sub_default!r})",
                    **_value_kind(sub_ann),
                )
        else:
            parser.add_argument(
                _flag("", name),
                dest=name,
                default=argparse.SUPPRESS,
                help=f"(default: {default!r})",
                **_value_kind(annotation),
            )
    return parser


def parse_config(config_cls: type[Config], argv: list[str] | None, description: str) -> Config:
    """Parse flags into the typed config; unspecified fields keep their defaults."""
    parser = build_parser(config_cls, description)
    given = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    for dotted, value in given.items():
        section, _, field = dotted.partition(".")
        if field:
            values.setdefault(section, {})[field] = value
        else:
            values[section] = value
    try:
        return config_cls.model_validate(_merge_defaults(config_cls, values))
    except (
        ValidationError
    ) as error:  # a section's own check (e.g. a count below 1): the flag and why, no trace
        parser.error("; ".join(
            f"{_flag('', '.'.join(str(part) for part in e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
            for e in error.errors()
        ))  # fmt: skip


def _merge_defaults(config_cls: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    merged = dict(values)
    for name, annotation, default in _fields(config_cls):
        if _is_section(annotation) and name in values:
            base = dataclasses.asdict(default) if dataclasses.is_dataclass(default) else default.model_dump()
            merged[name] = {**base, **values[name]}
    return merged
