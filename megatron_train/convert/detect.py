"""What `--load` holds, found as Megatron's `--auto-detect-ckpt-format` finds it, and opened in its format.

    flow         ours: iter_N/metadata.json with `format_version` (docs/architecture.md, checkpoints)
    torch        Megatron-LM's legacy files: iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt (or release/...)
    torch_dist   Megatron-Core's distributed checkpoint: iter_N/metadata.json with `sharded_backend`, .metadata

The latest marker (`latest_checkpointed_iteration.txt`: a number, or Megatron's "release") or `--ckpt-step` picks
the iteration. Ours opens as `SavedCheckpoint`; Megatron-LM's are converted in memory through the converter's
loaders (`in_memory.ConvertedCheckpoint`) as the run's model family (one with names in Megatron's formats:
`ModelFamily.megatron_names`, GPT's and BERT's). Anything else is refused with the `checkpoint_util` command that
converts it, or with what is wrong.
"""

from __future__ import annotations

import glob
import json
import os

from megatron_train.checkpointing.files import (
    DIST_METADATA_FILENAME,
    METADATA_FILENAME,
    TRACKER_FILENAME,
    CheckpointError,
    checkpoint_dir,
    missing_file_error,
)
from megatron_train.checkpointing.saved import SavedCheckpoint
from megatron_train.convert import megatron, torch_dist
from megatron_train.convert.in_memory import converted_dist, converted_legacy
from megatron_train.families.registry import get_family, is_builtin


def converter_command(load_dir: str, loader: str, model_type: str) -> str:
    """The checkpoint_util command that writes `load_dir` as one of ours beside it."""
    return (
        f"python -m megatron_train.tools.checkpoint_util --model-type {model_type.upper()} --loader {loader} "
        f"--saver flow --load-dir {load_dir} --save-dir {load_dir.rstrip('/')}_flow"
    )


def checkpoint_format(iteration_dir: str, model_type: str = "gpt") -> str:
    """`flow`, `torch` or `torch_dist` for one iteration folder; CheckpointError naming what is wrong otherwise."""
    metadata_path = os.path.join(iteration_dir, METADATA_FILENAME)
    if os.path.exists(metadata_path):
        try:
            with open(metadata_path, "rb") as handle:
                metadata = json.loads(handle.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"checkpoint file {metadata_path} is not valid JSON ({error})") from error
        if isinstance(metadata, dict) and "sharded_backend" in metadata:
            return "torch_dist"
        if isinstance(metadata, dict) and "format_version" in metadata:
            return "flow"
        raise CheckpointError(
            f"{metadata_path} records neither a format_version (Megatron-Flow) nor a sharded_backend "
            "(Megatron-Core torch_dist): this folder is not a checkpoint either writes"
        )
    if glob.glob(os.path.join(glob.escape(iteration_dir), "mp_rank_*", megatron.CHECKPOINT_FILE)):
        return "torch"
    if os.path.exists(os.path.join(iteration_dir, ".metadata")) or glob.glob(
        os.path.join(glob.escape(iteration_dir), "*.distcp")
    ):
        raise CheckpointError(
            f"{iteration_dir} holds torch_dist files but no {METADATA_FILENAME}, which Megatron-Core writes last: "
            "the save did not finish; load another iteration (--ckpt-step N)"
        )
    if glob.glob(os.path.join(glob.escape(iteration_dir), "mp_rank_*", "model.safetensors")):
        raise missing_file_error(metadata_path)
    raise CheckpointError(
        f"{iteration_dir} is neither a Megatron-Flow checkpoint nor a Megatron-LM torch (mp_rank_*/"
        f"{megatron.CHECKPOINT_FILE}) or torch_dist ({METADATA_FILENAME}, .metadata) one; a checkpoint of another "
        f"format converts with {converter_command(os.path.dirname(iteration_dir), 'hf|megatron|torch_dist', model_type)}"
    )


def find_iteration_dir(load_dir: str, iteration: int | None, model_type: str = "gpt") -> str | None:
    """The iteration folder `--load` (with `--ckpt-step`) names; None when it holds no latest marker and
    nothing recognisable as a checkpoint (a fresh start)."""
    if iteration is not None:
        return checkpoint_dir(load_dir, iteration)
    marker = os.path.join(load_dir, TRACKER_FILENAME)
    if os.path.exists(marker):
        with open(marker, "rb") as handle:
            text = handle.read(64).decode("utf-8", "replace").strip()
        if text == "release":  # Megatron's released checkpoints
            return os.path.join(load_dir, "release")
        if not text.isdigit():
            raise CheckpointError(
                f"{marker} should hold an iteration number or 'release' but holds {text[:40]!r}"
            )
        return checkpoint_dir(load_dir, int(text))
    if os.path.exists(os.path.join(load_dir, METADATA_FILENAME)) or glob.glob(
        os.path.join(glob.escape(load_dir), "mp_rank_*")
    ):
        raise CheckpointError(
            f"--load {load_dir} is one iteration's folder: pass the folder that holds it and "
            f"{TRACKER_FILENAME} ({os.path.dirname(os.path.abspath(load_dir))})"
        )
    if os.path.exists(os.path.join(load_dir, "config.json")):
        raise CheckpointError(
            f"--load {load_dir} is a Hugging Face model folder: convert it first with "
            f"{converter_command(load_dir, 'hf', model_type)}, then --load the new folder with --finetune"
        )
    return None


def open_checkpoint(load_dir: str, iteration: int | None, model_type: str) -> SavedCheckpoint | None:
    """`load_dir`'s checkpoint (latest, or `iteration`) in whichever format it is, for a run of `model_type`
    (`names.model_type`); None when there is none to load. A torch_dist save of a training run of ours opens as
    Megatron-Core's (the whole model); training itself reads it rank by rank (`open_megatron_lm_checkpoint`)."""
    iteration_dir = _existing_iteration_dir(load_dir, iteration, model_type)
    if iteration_dir is None:
        return None
    found = checkpoint_format(iteration_dir, model_type)
    if found == "flow":
        return SavedCheckpoint(iteration_dir)
    return _converted(load_dir, iteration, iteration_dir, found, model_type)


def open_megatron_lm_checkpoint(
    load_dir: str, iteration: int | None, model_type: str
) -> SavedCheckpoint | None:
    """For a training run's --load: a Megatron-LM checkpoint converted in memory; None where `load_dir` holds one
    of ours (our files, or a torch_dist save of ours: `checkpointing.load_checkpoint` reads each rank's blocks of
    it and picks a newer non-persistent checkpoint) or nothing."""
    iteration_dir = _existing_iteration_dir(load_dir, iteration, model_type)
    if iteration_dir is None:
        return None
    found = checkpoint_format(iteration_dir, model_type)
    if found == "flow" or os.path.exists(os.path.join(iteration_dir, DIST_METADATA_FILENAME)):
        return None
    return _converted(load_dir, iteration, iteration_dir, found, model_type)


def _existing_iteration_dir(load_dir: str, iteration: int | None, model_type: str) -> str | None:
    iteration_dir = find_iteration_dir(load_dir, iteration, model_type)
    if iteration_dir is not None and not os.path.isdir(iteration_dir):
        saved = sorted(name for name in os.listdir(load_dir) if name.startswith("iter_"))
        raise CheckpointError(f"checkpoint folder {iteration_dir} does not exist (iterations there: {saved})")
    return iteration_dir


def _converted(
    load_dir: str, iteration: int | None, iteration_dir: str, found: str, model_type: str
) -> SavedCheckpoint:
    """A Megatron-LM `torch` or `torch_dist` checkpoint converted in memory as the run's family."""
    family = get_family(model_type) if is_builtin(model_type) else None
    if family is None or family.megatron_names is None:
        raise CheckpointError(
            f"{iteration_dir} is a Megatron-LM {found} checkpoint; those are read for the families with names in "
            f"Megatron's formats (GPT and BERT: the converter's --model-type), not for this {model_type} run"
        )
    if found == "torch":
        return converted_legacy(megatron.open_checkpoint(load_dir, iteration), family)
    return converted_dist(torch_dist.open_checkpoint(load_dir, iteration), family)
