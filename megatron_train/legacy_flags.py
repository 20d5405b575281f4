"""Flags of older Megatron-LM versions, as its README commands and example scripts since 2020 spell them.

A renamed flag sets what its successor sets and logs one deprecation line naming the successor
(`--activations-checkpoint-method uniform` is read as `--recompute-granularity full --recompute-method uniform`).
A retired flag, one Megatron itself refused, stays registered (so `--help` lists it) and is refused with a
one-line error naming the flag to use instead. No torch here: `stages.tokenize` registers its own old flags.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)
GIVEN = object()  # in `Renamed.sets`: the value given on the command line


@dataclass(frozen=True)
class Renamed:
    """`flag` as Megatron later spelled it: `sets` (dest -> value, or GIVEN) always, `implied` (the old flag's
    own defaults) unless the command line sets that dest too. `successor` is the new spelling, `{}` the value."""

    flag: str
    successor: str
    sets: dict[str, Any]
    implied: dict[str, Any] = field(default_factory=dict)
    takes_value: bool = True
    type: Callable[[str], Any] = str
    choices: Sequence[Any] | None = None
    why: str = "Megatron renamed it"


@dataclass(frozen=True)
class Retired:
    """`flag` as Megatron retired it (it refused it too): refused, naming `use`."""

    flag: str
    use: str


class _RenamedAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, legacy: Renamed) -> None:
        self.renamed = legacy
        super().__init__(
            option_strings,
            dest,
            nargs=None if legacy.takes_value else 0,
            type=legacy.type if legacy.takes_value else None,
            choices=legacy.choices,
            default=argparse.SUPPRESS,
            help=f"Deprecated ({legacy.why}): read as {legacy.successor.format(dest.upper())}.",
        )

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any, option=None
    ):
        renamed = self.renamed
        for dest, setting in renamed.sets.items():
            setattr(namespace, dest, value if setting is GIVEN else setting)
        for dest, setting in renamed.implied.items():
            if not hasattr(namespace, dest):
                setattr(namespace, dest, setting)
        given = renamed.flag if not renamed.takes_value else f"{renamed.flag} {value}"
        if int(os.environ.get("RANK", "0")) == 0:
            logger.warning(
                "%s is deprecated (%s): read as %s", given, renamed.why, renamed.successor.format(value)
            )


class _RetiredAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, legacy: Retired) -> None:
        self.retired = legacy
        super().__init__(
            option_strings,
            dest,
            default=argparse.SUPPRESS,
            help=f"No longer valid (Megatron retired it): use {legacy.use}.",
        )

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any, option=None
    ):
        parser.error(f"{self.retired.flag} is no longer valid (Megatron retired it): use {self.retired.use}")


def add_legacy_flags(parser: argparse.ArgumentParser, flags: Sequence[Renamed | Retired]) -> None:
    """Register `flags` in their own argument group of `parser`."""
    group = parser.add_argument_group("older Megatron flags")
    for flag in flags:
        action = _RenamedAction if isinstance(flag, Renamed) else _RetiredAction
        dest = flag.flag.lstrip("-").replace("-", "_")  # never set: the actions set their successors' dests
        group.add_argument(flag.flag, action=action, dest=dest, legacy=flag)


# The training command line's old flags (pretrain_*, and tasks.main / the generation server, which take it too).
TRAINING_FLAGS: tuple[Renamed | Retired, ...] = (
    Renamed(
        "--checkpoint-activations",
        "--recompute-granularity full (--recompute-method uniform --recompute-num-layers 1 unless given)",
        sets={"recompute_granularity": "full"},
        implied={"recompute_method": "uniform", "recompute_num_layers": 1},
        takes_value=False,
    ),
    Renamed(
        "--activations-checkpoint-method",
        "--recompute-granularity full --recompute-method {} (--recompute-num-layers 1 unless given)",
        sets={"recompute_granularity": "full", "recompute_method": GIVEN},
        implied={"recompute_num_layers": 1},
        choices=("uniform", "block"),
    ),
    Renamed(
        "--activations-checkpoint-num-layers",
        "--recompute-num-layers {}",
        {"recompute_num_layers": GIVEN},
        type=int,
    ),
    Renamed("--DDP-impl", "--ddp-impl {}", {"ddp_impl": GIVEN}, choices=("local", "torch")),
    Renamed(
        "--use-rotary-position-embeddings",
        "--position-embedding-type rope",
        {"position_embedding_type": "rope"},
        takes_value=False,
    ),
    Renamed(  # Megatron's rope models passed it beside rope: it drops only the learned table
        "--no-position-embedding",
        "--position-embedding-type none (unless rope is given)",
        sets={},
        implied={"position_embedding_type": "none"},
        takes_value=False,
    ),
    Retired("--batch-size", "--micro-batch-size (per rank) and --global-batch-size"),
    Retired("--warmup", "--lr-warmup-fraction (or --lr-warmup-iters / --lr-warmup-samples)"),
    Retired("--model-parallel-size", "--tensor-model-parallel-size"),
    Retired("--intra-layer-model-parallel-size", "--tensor-model-parallel-size"),
)
