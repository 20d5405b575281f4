"""Every rank's random states in a checkpoint: python, numpy, torch CPU and CUDA, and the model-parallel tracker.

They are per rank, so they load only under the (TP, PP, CP) layout that saved them, as in Megatron: a resumed run
then draws the dropout masks the uninterrupted run would have drawn (docs/architecture.md, reproducibility).
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_train.checkpointing.files import (
    CheckpointError,
    CheckpointFiles,
    FileRecord,
    write_json,
    write_tensors,
)
from megatron_train.parallel.random import get_rng_tracker

logger = logging.getLogger(__name__)

RNG_DIR = "rng"


def global_rank() -> int:
    """This process's rank in the whole job (0 without a process group): what names its RNG files."""
    return dist.get_rank() if dist.is_initialized() else 0


def _rank_prefix(iteration_dir: str) -> str:
    return os.path.join(iteration_dir, RNG_DIR, f"rank_{global_rank():05d}")


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's random states: tensors (torch, CUDA, tracker) and JSON (python, numpy)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{index}"] = cuda_state
    for name, tracker_state in get_rng_tracker().get_states().items():
        tensors[f"tracker/{name}"] = tracker_state
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    meta = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in sorted(tensors) if k.startswith("cuda_")])
    tracker = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("tracker/")}
    if tracker:
        get_rng_tracker().set_states(tracker)
    py_version, py_state, py_gauss = meta["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = meta["numpy"]
    np.random.set_state((np_kind, np.array(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))


def save_rng_state(iteration_dir: str) -> dict[str, FileRecord]:
    """This rank's rng/rank_<rank>.safetensors and .json; returns their records, keyed like metadata.json's."""
    tensors, meta = rng_state()
    prefix = _rank_prefix(iteration_dir)
    name = os.path.basename(prefix)
    return {
        f"{RNG_DIR}/{name}.safetensors": write_tensors(prefix + ".safetensors", tensors, {}),
        f"{RNG_DIR}/{name}.json": write_json(prefix + ".json", meta),
    }


def load_rng_state(
    files: CheckpointFiles, metadata: dict, saved_layout: tuple[int, ...], our_layout: tuple[int, ...]
) -> None:
    """This rank's RNG states; skipped (as --no-load-rng) when (TP, PP, CP) changed, as Megatron does: another
    layout's per-rank streams mean nothing here."""
    if saved_layout != our_layout:
        if global_rank() == 0:
            logger.warning(
                "(TP, PP, CP) changed from %s to %s: RNG states are per rank and do not carry over, so they are "
                "not loaded (as --no-load-rng); dropout continues from this run's --seed",
                saved_layout,
                our_layout,
            )
        return
    prefix = _rank_prefix(files.iteration_dir)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if metadata["world_size"] != world_size or not os.path.exists(prefix + ".safetensors"):
        raise CheckpointError(
            f"{files.iteration_dir} holds no RNG state for rank {global_rank()} of {world_size} (saved by "
            f"{metadata['world_size']} ranks, or with --no-save-rng); pass --no-load-rng to continue "
            "with fresh RNG states"
        )
    set_rng_state(files.read_tensors(prefix + ".safetensors"), files.read_json(prefix + ".json"))
