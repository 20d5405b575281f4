"""`--ckpt-format torch_dist`: training checkpoints as Megatron-Core writes them, every rank writing its own shards
through PyTorch's distributed checkpoint (DCP), read back by any (TP, PP, DP, CP) layout.

    <save>/iter_0000100/__R_0.distcp     the chunks rank R wrote (R: global rank)
    <save>/iter_0000100/.metadata        DCP's index: every key's global shape and where its chunks lie
    <save>/iter_0000100/common.pt        Megatron's common state (args, iteration) for Megatron-Core's loaders
    <save>/iter_0000100/rng/rank_*.*     every rank's RNG states (ours)
    <save>/iter_0000100/flow_metadata.json   our metadata (progress, args, layout, scheduler, the optimizer's
                                         groups and scalars) and the size and hash of every file
    <save>/iter_0000100/metadata.json    {"sharded_backend": "torch_dist", ...}: Megatron-Core's record,
                                         written last, then the latest marker

Keys are Megatron-Core's (`checkpointing.dcp.core_key`: layers stacked on a first axis, norms under their fused
names, the padded vocabulary, a tied output layer saved once as the embedding, empty `_extra_state` objects), so
megatron-core's `dist_checkpointing` and our converter read it. A model tensor is written by one rank of the
data x context parallel replicas that hold it (spread over them round-robin with --ckpt-fully-parallel-save, the
default; TP rank 0 for one replicated over TP); an MoE expert weight by one of its expert DP replicas, each EP
rank's experts at their place on the expert axis of Megatron-Core's key, so any EP / expert TP reads them back. The optimizer's state goes under
`optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<model key>` in model space, each rank writing the part it holds:
under the distributed optimizer a DP rank's part of a param is a range of its flattened elements, written as the
rectangular blocks that range covers (`flat_range_boxes`), so nothing is gathered to one rank and any layout
reads back whatever blocks it needs (Megatron-Core's fully sharded model-space format).

With --async-save the chunks are copied to CPU memory, and a thread writes them while training goes on: DCP's
save over the gloo checkpoint group, every rank's hash of its own files, then rank 0's metadata.json and the
latest marker, so a save a kill interrupts is a folder without metadata.json that no load takes for complete
(docs/architecture.md, checkpoints).
"""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing.dcp import (
    CHECKPOINT_VERSION,
    Chunk,
    ChunkLoadPlanner,
    ChunkSavePlanner,
    CoreKey,
    Destination,
    SafeReader,
    core_key,
    extra_state_objects,
    megatron_args,
    stacked_layers,
    tp_pieces,
)
from megatron_train.checkpointing.files import (
    DIST_METADATA_FILENAME,
    METADATA_FILENAME,
    CheckpointError,
    CheckpointFiles,
    FileRecord,
    checkpoint_dir,
    write_marker,
)
from megatron_train.checkpointing.layout import ExpertLayout, TensorSharding
from megatron_train.checkpointing.names import (
    StageModel,
    current_expert_layout,
    expert_names,
    global_names,
    owned,
    stage_module,
)
from megatron_train.checkpointing.rng import save_rng_state
from megatron_train.parallel import state
from storage.atomic import atomic_path, atomic_write_text
from storage.fingerprint import hash_file

logger = logging.getLogger(__name__)

BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
COMMON_FILE = "common.pt"
OPTIMIZER_PREFIX = "optimizer.state"
# What --dist-ckpt-strictness does with keys the run expects that the checkpoint lacks ("missing": raise, or skip
# them, leaving those tensors as initialised) and with keys the checkpoint has that the run does not load
# ("unexpected": not checked, logged, or raised), as Megatron-Core's StrictHandling.
STRICTNESS = {
    "assume_ok_unexpected": ("raise", "ignore"),
    "log_unexpected": ("skip", "log"),
    "log_all": ("log", "log"),
    "raise_unexpected": ("skip", "raise"),
    "raise_all": ("raise", "raise"),
    "return_unexpected": ("skip", "log"),
    "return_all": ("log", "log"),
    "ignore_all": ("skip", "ignore"),
}


def is_dist_checkpoint(metadata: dict) -> bool:
    """A saved iteration (its `files.read_metadata`) is one of our torch_dist saves."""
    return metadata.get("sharded_backend") == "torch_dist"


# -- which blocks of a global tensor a rank holds ----------------------------------------------------------------


def flat_range_boxes(
    shape: tuple[int, ...], start: int, end: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [start, end) of a row-major tensor of `shape` as rectangular boxes (offsets, sizes), in order:
    a partial first row, whole rows, a partial last row, recursively. Each box is a contiguous run of the flat
    elements, so box i holds the next prod(sizes) of them."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner

    def within(row: int, low: int, high: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [
            ((row, *o), (1, *s))
            for o, s in flat_range_boxes(shape[1:], low - row * inner, high - row * inner)
        ]

    if first == last:
        return within(first, start, end)
    boxes = []
    full_from, full_to = first, last + 1
    if start > first * inner:
        boxes += within(first, start, (first + 1) * inner)
        full_from = first + 1
    if end < (last + 1) * inner:
        full_to = last
    if full_to > full_from:
        boxes.append(((full_from, *[0] * (len(shape) - 1)), (full_to - full_from, *shape[1:])))
    if full_to == last:
        boxes += within(last, last * inner, end)
    return boxes


@dataclass(frozen=True)
class Block:
    """A block of a global tensor held by this rank: `take(flat)` is its view of the 1-D tensor that holds the
    elements [start, end) of the rank's TP shard (the range its `flat_range_boxes` came from), `offsets` its
    place in the global tensor."""

    position: int  # where its box starts in the flat range
    box: tuple[int, ...]
    narrow: tuple[int, int, int] | None  # (dim, start, length) within the box: a box cut at TP pieces
    offsets: tuple[int, ...]

    def take(self, flat: torch.Tensor) -> torch.Tensor:
        view = flat[self.position : self.position + math.prod(self.box)].view(self.box)
        return view if self.narrow is None else view.narrow(*self.narrow)


def shard_blocks(
    shape: tuple[int, ...], start: int, end: int, sharding: TensorSharding, tp: int, tp_rank: int
) -> list[Block]:
    """The blocks of the global tensor that elements [start, end) of TP rank `tp_rank`'s shard (of `shape`) are:
    each box of the range, cut where the shard's TP pieces meet (`checkpointing.dcp.tp_pieces`: one per stride)."""
    blocks, position = [], 0
    dim = sharding.partition_dim
    stride = sharding.partition_stride if sharding.is_split else 1
    piece = shape[dim] // stride if sharding.is_split else 0
    for offsets, sizes in flat_range_boxes(shape, start, end):
        if not sharding.is_split:
            blocks.append(Block(position, sizes, None, offsets))
        else:
            low, high = offsets[dim], offsets[dim] + sizes[dim]
            for part in range(low // piece, (high - 1) // piece + 1):
                begin, stop = max(low, part * piece), min(high, (part + 1) * piece)
                at = list(offsets)
                at[dim] = (part * tp + tp_rank) * piece + begin - part * piece
                blocks.append(Block(position, sizes, (dim, begin - low, stop - begin), tuple(at)))
        position += math.prod(sizes)
    return blocks


@dataclass(frozen=True)
class HeldTensor:
    """One checkpoint tensor of this rank: its global name, the rank's TP shard and how the shard was cut; an MoE
    expert weight (`experts`: this rank's place among the expert ranks) is cut over expert TP and holds the EP
    rank's experts, a block of the layer's on the first axis."""

    name: str
    local: torch.Tensor
    sharding: TensorSharding
    tp_size: int
    tp_rank: int
    experts: ExpertLayout | None = None

    @property
    def global_shape(self) -> tuple[int, ...]:
        shape = list(self.local.shape)
        if self.sharding.is_split:
            shape[self.sharding.partition_dim] *= self.tp_size
        if self.experts is not None:
            shape[0] *= self.experts.ep_size
        return tuple(shape)

    @property
    def expert_range(self) -> range:
        """The layer's experts this rank holds (global indices); empty for a tensor that is not an expert's."""
        if self.experts is None:
            return range(0)
        first = self.experts.ep_rank * self.local.shape[0]
        return range(first, first + self.local.shape[0])

    def global_offsets(self, offsets: Sequence[int]) -> tuple[int, ...]:
        """Offsets in the rank's TP-merged tensor (its experts) as offsets in the layer's global tensor."""
        offsets = tuple(offsets)
        return offsets if self.experts is None else (offsets[0] + self.expert_range.start, *offsets[1:])

    def pieces(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """The rank's shard as contiguous pieces at their global offsets (`checkpointing.dcp.tp_pieces`)."""
        return [
            (piece, self.global_offsets(offsets))
            for piece, offsets in tp_pieces(self.local, self.sharding, self.tp_size, self.tp_rank)
        ]

    def blocks(self, start: int, end: int) -> list[Block]:
        """The blocks of the global tensor that elements [start, end) of the rank's shard are (`shard_blocks`)."""
        return [
            dataclasses.replace(block, offsets=self.global_offsets(block.offsets))
            for block in shard_blocks(
                tuple(self.local.shape), start, end, self.sharding, self.tp_size, self.tp_rank
            )
        ]


def _sharding(param: torch.Tensor | None) -> TensorSharding:
    if param is None or not getattr(param, "tensor_model_parallel", False):
        return TensorSharding()
    return TensorSharding(int(param.partition_dim), int(getattr(param, "partition_stride", 1)))


def held_tensors(model: StageModel, config: MegatronConfig, with_tied_copy: bool) -> dict[str, HeldTensor]:
    """This stage's tensors by state-dict name (`<chunk>.<name>` for several chunks); the tied output layer's copy
    (named as the embedding) only `with_tied_copy` (a load fills it, a save leaves it to the first stage)."""
    names = global_names(model, config)
    names = names if with_tied_copy else owned(names)
    module = stage_module(model)
    params = dict(module.named_parameters())
    experts = expert_names(module, names)
    layout = current_expert_layout()
    tp, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    weights = module.state_dict(keep_vars=True)
    held = {}
    for local, name in names.items():
        sharding, weight = _sharding(params.get(local)), weights[local].detach()
        if local in experts:
            held[local] = HeldTensor(name, weight, sharding, layout.etp_size, layout.etp_rank, layout)
        else:
            held[local] = HeldTensor(name, weight, sharding, tp, tp_rank)
    return held


def _writer_of(position: int, tensor: HeldTensor, fully_parallel: bool) -> bool:
    """This rank writes the tensor at `position` (of a stage's sorted list) of its replicas (DP x CP, an expert
    weight's expert DP): (expert) TP rank 0 of a replicated one, the replica `position` mod their number (fully
    parallel) or the first."""
    if not tensor.sharding.is_split and tensor.tp_rank != 0:
        return False
    if tensor.experts is not None:
        replicas, rank = state.get_expert_data_parallel_world_size(), state.get_expert_data_parallel_rank()
    else:
        replicas = state.get_data_parallel_world_size(with_context_parallel=True)
        rank = state.get_data_parallel_rank(with_context_parallel=True)
    return rank == (position % replicas if fully_parallel else 0)


# -- save --------------------------------------------------------------------------------------------------------


@dataclass
class SavePlan:
    """What this rank writes of one iteration (copied to CPU memory for an async save) and its part of the
    optimizer's JSON."""

    chunks: dict[str, list[Chunk]]
    objects: dict[str, io.BytesIO]
    optimizer_meta: dict | None


def plan_save(model: StageModel, optimizer: Any | None, config: MegatronConfig, copy: bool) -> SavePlan:
    """This rank's chunks of the model and of the optimizer state it holds, `copy`ed to CPU memory for a write
    that runs while training moves on."""
    num_layers, stacked = config.model.num_layers, stacked_layers(config.model)
    fully_parallel = config.checkpoint.ckpt_fully_parallel_save

    def stage(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu", copy=True).contiguous() if copy else tensor.detach().contiguous()

    held = held_tensors(model, config, with_tied_copy=False)
    order = {local: position for position, local in enumerate(sorted(held, key=lambda n: held[n].name))}
    chunks: dict[str, list[Chunk]] = {}
    objects: dict[str, io.BytesIO] = {}

    def add(prefix: str, tensor: HeldTensor, data: torch.Tensor, offsets: tuple[int, ...]) -> None:
        """A block of `tensor` under Megatron-Core's key after `prefix` (the optimizer's `optimizer.state.<state>.`)."""
        core = core_key(tensor.name, num_layers, stacked)
        view, at, shape = core.place(data, offsets, tensor.global_shape)
        chunks.setdefault(prefix + core.key, []).append(Chunk(stage(view), at, shape))

    for local, tensor in held.items():
        if _writer_of(order[local], tensor, fully_parallel):
            for piece, offsets in tensor.pieces():
                add("", tensor, piece, offsets)
            core = core_key(tensor.name, num_layers, stacked)
            objects.update(extra_state_objects(core, tensor.expert_range, config.model.num_experts or 0))
    if optimizer is None or config.checkpoint.no_save_optim:
        return SavePlan(chunks, objects, None)
    scalars, tensor_states = {}, {}
    for index, start, end in optimizer.local_param_ranges():
        local = optimizer.names[index]
        if local not in held:  # the tied output layer's copy: the first stage saves the embedding's state
            continue
        tensor, views = held[local], optimizer.local_state(index)
        scalars[tensor.name] = optimizer.local_scalars(index)
        tensor_states[tensor.name] = [key for key in views if key != "fp32_param"]
        if optimizer.shards_state_over_data_parallel:  # each (expert) DP rank writes the part it holds
            writes = tensor.sharding.is_split or tensor.tp_rank == 0
        else:
            writes = _writer_of(order[local], tensor, fully_parallel)
        if not writes:
            continue
        blocks = tensor.blocks(start, end)
        for state_name, flat in views.items():
            for block in blocks:
                add(f"{OPTIMIZER_PREFIX}.{state_name}.", tensor, block.take(flat), block.offsets)
    return SavePlan(
        chunks, objects, {**optimizer.state_meta(), "scalars": scalars, "tensor_states": tensor_states}
    )


def write_common_state(
    iteration_dir: str, config: MegatronConfig, padded_vocab_size: int, iteration: int
) -> FileRecord:
    """common.pt: what Megatron-Core's loaders read of every torch_dist checkpoint (args, iteration)."""
    args = megatron_args(
        config,
        state.get_tensor_model_parallel_world_size(),
        state.get_pipeline_model_parallel_world_size(),
        padded_vocab_size,
        iteration,
    )
    args.ckpt_format = "torch_dist"
    path = os.path.join(iteration_dir, COMMON_FILE)
    with atomic_path(path) as tmp:
        torch.save(
            {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
             "num_floating_point_operations_so_far": 0},
            tmp,
        )  # fmt: skip
    return {"size": os.path.getsize(path), "hash": hash_file(path)}


def write_shards(iteration_dir: str, plan: SavePlan) -> dict[str, FileRecord]:
    """Every rank's chunks through DCP (a collective over the checkpoint group), then each rank's records of the
    files it wrote (rank 0 also `.metadata`)."""
    group = state.get_checkpoint_group()
    writer = dcp.FileSystemWriter(iteration_dir, single_file_per_rank=True, thread_count=1)
    try:
        dcp.save(
            {},
            storage_writer=writer,
            planner=ChunkSavePlanner(plan.chunks, plan.objects),
            process_group=group,
        )
    except OSError as error:
        raise CheckpointError(f"could not write checkpoint {iteration_dir}: {error}") from error
    except dcp.api.CheckpointException as error:
        raise CheckpointError(
            f"could not write checkpoint {iteration_dir}: {_first_failure(error)}"
        ) from error
    rank = dist.get_rank(group)
    mine = glob.glob(os.path.join(glob.escape(iteration_dir), f"__{rank}_*.distcp"))
    if rank == 0:
        mine.append(os.path.join(iteration_dir, ".metadata"))
    return {
        os.path.relpath(path, iteration_dir): {"size": os.path.getsize(path), "hash": hash_file(path)}
        for path in mine
    }


def _first_failure(error: Exception) -> str:
    """What went wrong on the first rank a DCP CheckpointException reports (a full disk, say)."""
    failures = getattr(error, "failures", {}) or {}
    if failures:
        rank, failure = next(iter(sorted(failures.items())))
        return f"rank {rank}: {failure}"
    return str(error)


def gather_on_checkpoint_group(value: Any) -> list[Any]:
    """`value` of every rank (a collective over the checkpoint group: it also waits for every rank)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=state.get_checkpoint_group())
    return gathered


def merge_optimizer_meta(parts: list[dict | None]) -> dict | None:
    """Every rank's optimizer JSON as one: rank 0's groups and loss scaler, the union of the per-param entries
    (under the distributed optimizer a rank holds the state of only some params)."""
    parts = [part for part in parts if part is not None]
    if not parts:
        return None
    merged = {**parts[0], "scalars": {}, "tensor_states": {}}
    for part in parts:
        for key in ("scalars", "tensor_states"):
            for name, value in part[key].items():
                if value or name not in merged[key]:
                    merged[key][name] = value
    return merged


class AsyncSave:
    """The background write of one checkpoint (--async-save): a thread running `work`, whose error the training
    thread raises at `wait()`."""

    def __init__(self, work: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(work,), name="async-checkpoint-save", daemon=True
        )
        self.thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - re-raised in the training thread by wait()
            self.error = error

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


_PENDING: AsyncSave | None = None  # the async save still writing, if any


def wait_for_async_save() -> None:
    """Block until the async save in flight (if any) is complete on every rank; raise its error here."""
    global _PENDING
    pending, _PENDING = _PENDING, None
    if pending is not None:
        pending.wait()


def save_dist_checkpoint(
    root: str,
    iteration: int,
    model: StageModel,
    optimizer: Any | None,
    config: MegatronConfig,
    padded_vocab_size: int,
    metadata: dict,
) -> None:
    """Save iteration `iteration` under `root` in torch_dist (the folder prepared by the caller; `metadata`: what
    our metadata.json records besides the files and the optimizer). With --async-save the write runs in the
    background: the chunks are staged in CPU memory first, so training may change the weights at once."""
    global _PENDING
    wait_for_async_save()
    iteration_dir = checkpoint_dir(root, iteration)
    ckpt = config.checkpoint
    plan = plan_save(model, optimizer, config, copy=ckpt.async_save)
    optimizer_meta = merge_optimizer_meta(gather_on_checkpoint_group(plan.optimizer_meta))
    local_files = {} if ckpt.no_save_rng else save_rng_state(iteration_dir)
    first = dist.get_rank() == 0

    def write() -> None:
        files = {**local_files, **write_shards(iteration_dir, plan)}
        if first:
            files[COMMON_FILE] = write_common_state(iteration_dir, config, padded_vocab_size, iteration)
        records = {
            name: record for part in gather_on_checkpoint_group(files) for name, record in part.items()
        }
        if first:  # every rank's files are on disk: the folder is complete, then the marker moves
            ours = {**metadata, "optimizer": optimizer_meta, "files": dict(sorted(records.items()))}
            atomic_write_text(os.path.join(iteration_dir, DIST_METADATA_FILENAME), json.dumps(ours, indent=1))
            atomic_write_text(os.path.join(iteration_dir, METADATA_FILENAME), json.dumps(BACKEND))
            write_marker(root, iteration)
        logger.info("saved checkpoint at iteration %d to %s (torch_dist)", iteration, iteration_dir)

    if ckpt.async_save:
        _PENDING = AsyncSave(write)
    else:
        write()


# -- load --------------------------------------------------------------------------------------------------------


class VerifiedReader(SafeReader):
    """DCP's reader of one of our saves: the files a rank reads are checked against metadata.json's sizes and
    hashes before DCP reads them (`CheckpointFiles.verify`)."""

    def __init__(self, iteration_dir: str, files: CheckpointFiles) -> None:
        super().__init__(iteration_dir)
        self.files = files

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        self.files.verify(os.path.join(str(self.path), ".metadata"))
        return super().read_metadata(*args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        for item in plan.items:
            self.files.verify(
                os.path.join(str(self.path), self.storage_data[item.storage_index].relative_path)
            )
        return super().prepare_local_plan(plan)


def saved_tensor_shapes(iteration_dir: str, files: CheckpointFiles) -> dict[str, tuple[int, ...]]:
    """Every tensor key of the DCP index with its global shape."""
    index = VerifiedReader(iteration_dir, files).read_metadata()
    return {
        key: tuple(item.size)
        for key, item in index.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def _clip(view: torch.Tensor, offsets: tuple[int, ...], saved: tuple[int, ...]) -> torch.Tensor | None:
    """The part of a block (`view` at `offsets`) inside a saved tensor of shape `saved` (a smaller padded
    vocabulary than this run's: the rows beyond stay as they are, padding); None when none of it was saved."""
    for dim, (at, size, limit) in enumerate(zip(offsets, view.shape, saved, strict=True)):
        if at >= limit:
            return None
        if at + size > limit:
            view = view.narrow(dim, 0, limit - at)
    return view


@dataclass
class LoadRequests:
    """The blocks a rank reads, and for each optimizer param (by index) the flat tensors its blocks fill."""

    destinations: list[Destination]
    optimizer_states: dict[int, dict[str, torch.Tensor]]
    names: dict[int, str]  # optimizer param index -> global name

    def add(
        self, shapes: dict[str, tuple[int, ...]], prefix: str, core: CoreKey, tensor: HeldTensor,
        view: torch.Tensor, offsets: tuple[int, ...],
    ) -> None:  # fmt: skip
        """Ask for the block `view` of global tensor `tensor` (Megatron-Core's `core` after `prefix`) at
        `offsets`, cut to the saved shape."""
        key = prefix + core.key
        view, offsets, _ = core.place(view, offsets, tensor.global_shape)
        if key in shapes and len(shapes[key]) == view.dim():
            view = _clip(view, offsets, shapes[key])
        if view is not None:
            self.destinations.append(Destination(key, offsets, view))


def plan_load(
    model: StageModel,
    optimizer: Any | None,
    config: MegatronConfig,
    shapes: dict[str, tuple[int, ...]],
    tensor_states: dict[str, list[str]],
) -> LoadRequests:
    """What this rank reads: its TP shard of every model tensor into the params themselves, and with `optimizer`
    the blocks of its range of each param's state (`tensor_states`: the states saved per param) into new flat
    tensors (the tied output layer's copy reads the embedding's)."""
    num_layers, stacked = config.model.num_layers, stacked_layers(config.model)
    held = held_tensors(model, config, with_tied_copy=True)
    requests = LoadRequests([], {}, {})
    for tensor in held.values():
        core = core_key(tensor.name, num_layers, stacked)
        for piece, offsets in tensor.pieces():
            requests.add(shapes, "", core, tensor, piece, offsets)
    if optimizer is None:
        return requests
    for index, start, end in optimizer.local_param_ranges():
        tensor = held[optimizer.names[index]]
        states = ["fp32_param"] if optimizer.mixed_precision else []
        states += tensor_states.get(tensor.name, [])
        device = tensor.local.device
        flats = {name: torch.zeros(end - start, dtype=torch.float32, device=device) for name in states}
        requests.optimizer_states[index], requests.names[index] = flats, tensor.name
        core = core_key(tensor.name, num_layers, stacked)
        for block in tensor.blocks(start, end):
            for name, flat in flats.items():
                prefix = f"{OPTIMIZER_PREFIX}.{name}."
                requests.add(shapes, prefix, core, tensor, block.take(flat), block.offsets)
    return requests


def apply_strictness(
    requests: LoadRequests,
    shapes: dict[str, tuple[int, ...]],
    loads_optimizer: bool,
    strictness: str,
    where: str,
) -> None:
    """--dist-ckpt-strictness: drop (or refuse) the requests of keys the checkpoint lacks, and check the keys of
    what this run loads (model, and optimizer unless it loads none) that no rank asked for (a collective then)."""
    on_missing, on_unexpected = STRICTNESS[strictness]
    missing = sorted({d.key for d in requests.destinations if d.key not in shapes})
    if missing and on_missing == "raise":
        raise CheckpointError(
            f"{where} holds no {missing[:5]} ({len(missing)} keys this run loads are missing): load a checkpoint "
            "of this model, pass --no-load-optim if only optimizer keys are missing, or pick what a missing key "
            "does with --dist-ckpt-strictness (log_all, ignore_all, ...)"
        )
    if missing:
        if on_missing == "log":
            logger.warning("%s: keys missing from the checkpoint, left as they were: %s", where, missing)
        requests.destinations = [d for d in requests.destinations if d.key in shapes]
    if on_unexpected == "ignore":
        return
    asked = set().union(*gather_on_checkpoint_group({d.key for d in requests.destinations}))
    loaded = [key for key in shapes if loads_optimizer or not key.startswith("optimizer.")]
    unexpected = sorted(key for key in loaded if key not in asked)
    if unexpected and on_unexpected == "raise":
        raise CheckpointError(
            f"{where} holds keys this run does not load: {unexpected[:5]} ({len(unexpected)} in all); pass "
            "--dist-ckpt-strictness log_unexpected to load the rest anyway"
        )
    if unexpected:
        logger.warning("%s: keys in the checkpoint this run does not load: %s", where, unexpected)


def read_blocks(iteration_dir: str, files: CheckpointFiles, destinations: list[Destination]) -> None:
    """Every rank's blocks, through DCP (a collective over the checkpoint group)."""
    try:
        dcp.load(
            {},
            storage_reader=VerifiedReader(iteration_dir, files),
            planner=ChunkLoadPlanner(destinations),
            process_group=state.get_checkpoint_group(),
        )
    except dcp.api.CheckpointException as error:
        raise CheckpointError(
            f"could not read checkpoint {iteration_dir}: {_first_failure(error)}"
        ) from error


def load_dist_checkpoint(
    iteration_dir: str, metadata: dict, model: StageModel, optimizer: Any | None, config: MegatronConfig
) -> None:
    """Load one of our torch_dist saves into this rank's stage (and `optimizer`, when given), whatever layout
    saved it: every rank reads just its blocks (a collective over the checkpoint group)."""
    files = CheckpointFiles(iteration_dir, metadata)
    shapes = saved_tensor_shapes(iteration_dir, files)
    saved_optimizer = metadata.get("optimizer")
    if optimizer is not None and saved_optimizer is None:
        raise CheckpointError(
            f"{iteration_dir} holds no optimizer state (saved with --no-save-optim?); pass --no-load-optim to "
            "load the weights with a fresh optimizer"
        )
    tensor_states = saved_optimizer["tensor_states"] if optimizer is not None else {}
    requests = plan_load(model, optimizer, config, shapes, tensor_states)
    strictness = config.checkpoint.dist_ckpt_strictness
    apply_strictness(requests, shapes, optimizer is not None, strictness, iteration_dir)
    read_blocks(iteration_dir, files, requests.destinations)
    if optimizer is None:
        return
    for index, tensors in requests.optimizer_states.items():
        optimizer.set_local_state(index, tensors, saved_optimizer["scalars"].get(requests.names[index], {}))
    optimizer.finish_loading(saved_optimizer)
