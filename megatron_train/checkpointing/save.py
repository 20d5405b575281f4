"""Save a training checkpoint: every rank writes its part, rank 0 completes the folder (docs/architecture.md).

Each file is written atomically (`storage.atomic`) and hashed by the rank that wrote it; rank 0 gathers the
records, writes metadata.json (the folder is complete) and then the latest marker.

What a save may overwrite: a complete iteration folder belongs to the run that wrote it. A run may replace one
only when it resumed from an iteration of the same folder (its own history: a rewind with --ckpt-step, or a
save a kill interrupted before the marker moved); re-saving the very iteration it resumed from leaves the folder
as it is (it holds that state already). A run that started from scratch, with --finetune, or from another
folder refuses, naming the folder, instead of overwriting another run's checkpoint. An incomplete folder (no
metadata.json: a save that died) is removed and written again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch.distributed as dist

from megatron_train.arguments import MegatronConfig, config_to_dict
from megatron_train.checkpointing.dist_checkpoint import save_dist_checkpoint, wait_for_async_save
from megatron_train.checkpointing.files import (
    FORMAT_VERSION,
    CheckpointError,
    FileRecord,
    checkpoint_dir,
    is_complete,
    model_shard_dir,
    read_latest_iteration,
    write_json,
    write_marker,
    write_metadata,
    write_tensors,
)
from megatron_train.checkpointing.layout import true_vocab_range
from megatron_train.checkpointing.names import (
    StageModel,
    current_expert_layout,
    expert_names,
    global_names,
    model_type,
    owned,
    rename_optimizer_state,
    sharding_records,
    stage_module,
)
from megatron_train.checkpointing.progress import TrainingProgress
from megatron_train.checkpointing.rng import global_rank, save_rng_state
from megatron_train.families.registry import checkpoint_record
from megatron_train.parallel import state
from storage.atomic import final_name

logger = logging.getLogger(__name__)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def write_shard(
    shard_dir: str,
    weights: dict[str, Any],
    sharding: dict[str, dict[str, Any]],
    optimizer_state: tuple[dict[str, Any], dict] | None,
) -> dict[str, FileRecord]:
    """One (TP, PP) rank's files: model.safetensors and, given optimizer state, optimizer.safetensors/.json.

    Returns each file's record keyed by its path in the iteration folder (`mp_rank_00/model.safetensors`)."""
    name = os.path.basename(shard_dir)
    metadata = {"sharding": json.dumps(sharding)}  # one key (files.py); the version is in metadata.json
    records = {
        f"{name}/model.safetensors": write_tensors(f"{shard_dir}/model.safetensors", weights, metadata)
    }
    if optimizer_state is not None:
        tensors, meta = optimizer_state
        if tensors:  # safetensors cannot read back an empty file (an optimizer that never stepped)
            path = f"{shard_dir}/optimizer.safetensors"
            records[f"{name}/optimizer.safetensors"] = write_tensors(path, tensors, metadata)
        records[f"{name}/optimizer.json"] = write_json(f"{shard_dir}/optimizer.json", meta)
    return records


def write_metadata_and_marker(
    root: str, iteration: int, metadata: dict[str, Any], files: dict[str, FileRecord]
) -> None:
    """Complete a saved iteration: metadata.json listing every file's size and hash, then the latest marker
    (never before the folder is whole)."""
    write_metadata(checkpoint_dir(root, iteration), {**metadata, "files": dict(sorted(files.items()))})
    write_marker(root, iteration)


def _may_write(root: str, iteration_dir: str, progress: TrainingProgress) -> bool:
    """Whether this run writes `iteration_dir` (False: it is the checkpoint the run resumed from); raises
    when the folder holds another run's complete checkpoint (see the module docstring)."""
    if not is_complete(iteration_dir):
        return True
    loaded = progress.loaded_from
    if loaded is not None and _same_path(loaded, iteration_dir):
        return False
    if loaded is None or not _same_path(os.path.dirname(loaded), root):
        started = "from scratch or with --finetune" if loaded is None else f"from {loaded}"
        raise CheckpointError(
            f"{iteration_dir} already holds a complete checkpoint of another run (this run started {started}), "
            f"and saving would overwrite it: resume that run with --load {root}, or pass another --save folder"
        )
    return True


def _write_failure(error: OSError, iteration_dir: str) -> str:
    """What a failed write says in the one-line error: the file and the system's reason."""
    return f"writing {final_name(str(error.filename or iteration_dir))} failed ({error.strerror or error})"


def _gather_file_records(
    local: dict[str, FileRecord], failure: str | None
) -> tuple[dict[str, FileRecord], str | None]:
    """Every rank's file records and the first rank's write failure, if any rank had one (a collective: it also
    waits until every rank has written its files, so no rank is left waiting for one that failed)."""
    if not dist.is_initialized():
        return local, failure
    gathered: list[tuple[dict[str, FileRecord], str | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local, failure))
    records = {name: record for part, _ in gathered for name, record in part.items()}
    return records, next((failed for _, failed in gathered if failed is not None), None)


def save_checkpoint(
    iteration: int,
    model: StageModel,
    optimizer: Any | None,
    opt_param_scheduler: Any | None,
    progress: TrainingProgress,
    config: MegatronConfig,
    padded_vocab_size: int,
    root: str | None = None,
) -> str:
    """Save `progress` and the state of every rank under `root` (default `--save`)/iter_<iteration>, in our
    format or with --ckpt-format torch_dist Megatron-Core's (`dist_checkpoint`; in the background with
    --async-save). Returns the folder.

    `model` is the unwrapped module of this pipeline stage, or the list of its chunks (one per virtual stage,
    in order) when interleaved. Raises CheckpointError rather than overwrite another run's iteration.
    """
    wait_for_async_save()  # one save at a time: the previous one may still be writing this folder's marker
    names = owned(global_names(model, config))
    module = stage_module(model)
    root = config.checkpoint.save if root is None else root
    iteration_dir = checkpoint_dir(root, iteration)
    if not _may_write(root, iteration_dir, progress):
        logger.info("iteration %d is the checkpoint this run resumed from: %s left as it is", iteration, root)
        return iteration_dir
    if global_rank() == 0 and os.path.exists(iteration_dir):
        what = "a checkpoint of this run's history" if is_complete(iteration_dir) else "an unfinished save"
        logger.warning("replacing %s: %s", iteration_dir, what)
        shutil.rmtree(iteration_dir)
    _barrier()
    metadata = _metadata(
        iteration, opt_param_scheduler, progress, config, padded_vocab_size, model_type(model)
    )
    if config.checkpoint.ckpt_format == "torch_dist":
        save_dist_checkpoint(root, iteration, model, optimizer, config, padded_vocab_size, metadata)
        return iteration_dir
    files: dict[str, FileRecord] = {}
    experts = expert_names(module, names)
    dense = {local: name for local, name in names.items() if local not in experts}
    failure = None
    try:
        optimizer_state = None
        if optimizer is not None and not config.checkpoint.no_save_optim:
            # every DP rank asks: a distributed optimizer gathers its shards into per-param tensors here
            optimizer_state = optimizer.state_dict()
        pp_rank, pp_size = (
            state.get_pipeline_model_parallel_rank(),
            state.get_pipeline_model_parallel_world_size(),
        )
        # the dense weights from DP rank 0 of each (TP, PP) rank, the experts from expert-DP rank 0 of each
        # (expert TP, EP, PP) rank, each into a folder of its own (files.model_shard_dir)
        for part, writes, shard_dir in (
            (dense, state.get_data_parallel_rank(with_context_parallel=True) == 0,
             model_shard_dir(iteration_dir, state.get_tensor_model_parallel_rank(), pp_rank, pp_size)),
            (experts, bool(experts) and state.get_expert_data_parallel_rank() == 0,
             model_shard_dir(iteration_dir, state.get_expert_tensor_parallel_rank(), pp_rank, pp_size,
                             current_expert_layout().ep_rank)),
        ):  # fmt: skip
            if writes:
                weights = {
                    part[local]: tensor for local, tensor in module.state_dict().items() if local in part
                }
                part_optimizer = (
                    None if optimizer_state is None else rename_optimizer_state(*optimizer_state, part)
                )
                files.update(write_shard(shard_dir, weights, sharding_records(module, part), part_optimizer))
        if not config.checkpoint.no_save_rng:
            files.update(save_rng_state(iteration_dir))
    except OSError as error:  # a full disk, a read-only or vanished --save: every rank learns it below
        failure = _write_failure(error, iteration_dir)
    files, failure = _gather_file_records(files, failure)
    if global_rank() == 0 and failure is None:
        try:
            write_metadata_and_marker(
                root,
                iteration,
                metadata,
                files,
            )
        except OSError as error:
            failure = _write_failure(error, iteration_dir)
    _, failure = _gather_file_records({}, failure)  # rank 0's metadata write, seen by every rank
    if failure is not None:
        if global_rank() == 0:
            shutil.rmtree(iteration_dir, ignore_errors=True)
        _barrier()
        raise CheckpointError(
            f"cannot save iteration {iteration} to --save {root}: {failure}; the unfinished {iteration_dir} was "
            "removed. Free space on that file system, make it writable, or pass another --save"
        )
    logger.info("saved checkpoint at iteration %d to %s", iteration, iteration_dir)
    return iteration_dir


def prune_non_persistent(root: str) -> None:
    """Before a non-persistent save (Megatron's cleanup): remove every iteration folder of `root` but the one the
    latest marker names, so the newest complete checkpoint stays until the next one is complete (rank 0)."""
    if global_rank() != 0 or not os.path.isdir(root):
        return
    keep = read_latest_iteration(root)
    for name in os.listdir(root):
        if name.startswith("iter_") and name != os.path.basename(checkpoint_dir(root, keep or -1)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _metadata(
    iteration: int,
    opt_param_scheduler: Any | None,
    progress: TrainingProgress,
    config: MegatronConfig,
    padded_vocab_size: int,
    saved_model_type: str,
) -> dict[str, Any]:
    """metadata.json but its file records: model family, progress, vocabulary, layout, scheduler and the run's
    args."""
    tp_size = state.get_tensor_model_parallel_world_size()
    return {
        "format_version": FORMAT_VERSION,
        **checkpoint_record(saved_model_type, config.model.model_family),
        "iteration": iteration,
        "consumed_train_samples": progress.consumed_train_samples,
        "consumed_valid_samples": progress.consumed_valid_samples,
        "padded_vocab_size": padded_vocab_size,
        # the tokenizer's vocabulary size is low < V <= high: what a later layout may re-pad from
        "true_vocab_size_range": true_vocab_range(
            padded_vocab_size, config.tokenizer.make_vocab_size_divisible_by * tp_size
        ),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tensor_model_parallel_size": tp_size,
        "pipeline_model_parallel_size": state.get_pipeline_model_parallel_world_size(),
        # informative only: loading does not depend on it
        "virtual_pipeline_model_parallel_size": state.get_virtual_pipeline_model_parallel_world_size(),
        "data_parallel_size": state.get_data_parallel_world_size(),
        "context_parallel_size": state.get_context_parallel_world_size(),
        "expert_model_parallel_size": state.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": state.get_expert_tensor_parallel_world_size(),
        "opt_param_scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None,
        "args": config_to_dict(config),
    }
