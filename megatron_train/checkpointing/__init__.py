"""Save and load training checkpoints: safetensors for tensors, JSON for everything else, no pickles.

Layout of a run directory (Megatron's names where Megatron has them; docs/architecture.md, checkpoints):

    <save>/latest_checkpointed_iteration.txt     written atomically, only after the folder is complete
    <save>/iter_0000100/metadata.json            iteration, consumed samples, args, layout, scheduler, and the
                                                 size and xxh3 hash of every file below (written last)
    <save>/iter_0000100/mp_rank_00[_000]/model.safetensors     this (TP, PP) rank's shard of the weights
    <save>/iter_0000100/mp_rank_00[_000]/optimizer.safetensors fp32 main params and Adam moments (DP rank 0)
    <save>/iter_0000100/mp_rank_00[_000]/optimizer.json        step counts, param groups, loss scaler
    <save>/iter_0000100/rng/rank_00000.safetensors / .json     every rank's python, numpy, torch, CUDA and
                                                               model-parallel-tracker RNG states

Tensors are stored under global names (`decoder.layers.<global layer>.`), each with its global shape and its
TP split (Megatron's tensor_model_parallel, partition_dim, partition_stride) and PP stage in the safetensors
metadata; optimizer tensors are `<param name>.<state>` (main_param, exp_avg, exp_avg_sq) and shard like their
param. So a checkpoint saved under one (TP, PP, DP) layout loads under another: each rank reads all TP shards
of the tensors it holds, merges them and keeps its slice (`layout`). RNG states are per rank and load only
when (TP, PP) is unchanged, as in Megatron; `tools/checkpoint_util.py` reshards offline.

Interleaved pipelines (--num-layers-per-virtual-pipeline-stage) save and load a LIST of model chunks: a rank's
shard file holds all its chunks' tensors, each under its global name (chunk c's layers come from
`get_layer_range(..., c, virtual size)`), and optimizer state keyed `<chunk>.<name>` maps to the same names.
Loading finds every tensor by its record, whichever file holds it, so the format is the same with or without
virtual stages: a checkpoint saved with them loads without them (any TP, PP) and vice versa.

Modules: `files` (paths, atomic hashed writes, verified reads), `layout` (pure resharding rules), `names`
(global names and sharding records), `saved` (a saved iteration as global tensors), `save`, `load`
(compatibility checks), `rng`, `progress`, `inference` (one model from any layout).
"""

from megatron_train.checkpointing.files import (
    FORMAT_VERSION,
    METADATA_FILENAME,
    TRACKER_FILENAME,
    CheckpointError,
    checkpoint_dir,
    model_shard_dir,
    read_latest_iteration,
    read_metadata,
    require_iteration_dir,
    resolve_iteration_dir,
)
from megatron_train.checkpointing.inference import load_model_for_inference, load_model_stage_for_inference
from megatron_train.checkpointing.load import MODEL_ARGS_TO_CHECK, check_compatible, load_checkpoint
from megatron_train.checkpointing.names import sharding_record
from megatron_train.checkpointing.progress import TrainingProgress
from megatron_train.checkpointing.save import save_checkpoint, write_metadata_and_marker, write_shard
from megatron_train.checkpointing.saved import SavedCheckpoint, saved_true_vocab_range

__all__ = [
    "FORMAT_VERSION",
    "METADATA_FILENAME",
    "MODEL_ARGS_TO_CHECK",
    "TRACKER_FILENAME",
    "CheckpointError",
    "SavedCheckpoint",
    "TrainingProgress",
    "check_compatible",
    "checkpoint_dir",
    "load_checkpoint",
    "load_model_for_inference",
    "load_model_stage_for_inference",
    "model_shard_dir",
    "read_latest_iteration",
    "read_metadata",
    "require_iteration_dir",
    "resolve_iteration_dir",
    "save_checkpoint",
    "saved_true_vocab_range",
    "sharding_record",
    "write_metadata_and_marker",
    "write_shard",
]
