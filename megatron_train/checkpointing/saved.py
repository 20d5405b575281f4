"""One saved iteration seen as global tensors, whatever (TP, PP, virtual) layout wrote it (docs/architecture.md).

Loading for training, the inference loader and the offline converter all read through `SavedCheckpoint`: it
finds each tensor by its record, merges its TP shards, re-pads the vocabulary, and verifies every file against
the hashes in metadata.json before using its bytes (`files.CheckpointFiles`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError

from megatron_train.checkpointing.files import (
    METADATA_FILENAME,
    CheckpointError,
    CheckpointFiles,
    model_shard_dir,
    read_metadata,
)
from megatron_train.checkpointing.layout import (
    VOCAB_PARAMS,
    ExpertLayout,
    TensorSharding,
    merge_expert_shards,
    merge_tp_shards,
    module_order,
    resize_vocab,
    sharding_of,
    split_expert_tensor,
    split_tp_shard,
    true_vocab_range,
)
from megatron_train.checkpointing.names import param_of
from megatron_train.checkpointing.rng import load_rng_state

# metadata.json's layout: each an integer of at least 1, checked before a file is opened.
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "padded_vocab_size")


def saved_true_vocab_range(metadata: dict) -> tuple[int, int]:
    """The range of true vocabulary sizes a checkpoint's padded vocabulary allows (older ones: from its TP)."""
    if "true_vocab_size_range" in metadata:
        return tuple(metadata["true_vocab_size_range"])
    divisor = metadata["args"].get("tokenizer", {}).get("make_vocab_size_divisible_by", 128)
    return true_vocab_range(metadata["padded_vocab_size"], divisor * metadata["tensor_model_parallel_size"])


class SavedCheckpoint:
    """One saved iteration seen as global tensors, whatever (TP, PP) layout wrote it.

    Opening reads metadata.json and each pipeline stage's shard header; tensors are read only when asked
    for, from the TP shards that hold them, each file verified against its recorded hash before its first use.
    MoE experts live in folders of their own, one per (expert TP, PP, EP) rank (`files.model_shard_dir`); their
    records carry their EP rank and size, and their global tensor holds every expert of the layer.
    """

    def __init__(self, iteration_dir: str) -> None:
        self.iteration_dir = iteration_dir
        self.metadata = read_metadata(iteration_dir)
        self.files = CheckpointFiles(iteration_dir, self.metadata)
        where = os.path.join(iteration_dir, METADATA_FILENAME)
        for key in LAYOUT_KEYS:
            value = self.metadata.get(key)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise CheckpointError(f"{where}: {key} is {value!r}, not an integer of at least 1")
        self.tp_size: int = self.metadata["tensor_model_parallel_size"]
        self.pp_size: int = self.metadata["pipeline_model_parallel_size"]
        self.padded_vocab_size: int = self.metadata["padded_vocab_size"]
        dense_folders = [
            name
            for name in os.listdir(iteration_dir)
            if name.startswith("mp_rank_") and "_expert_" not in name
        ]
        if len(dense_folders) != self.tp_size * self.pp_size:
            raise CheckpointError(
                f"{where}: tensor_model_parallel_size {self.tp_size} x pipeline_model_parallel_size "
                f"{self.pp_size}, but {iteration_dir} holds {len(dense_folders)} rank folders"
            )
        # the experts' layout when saved (older checkpoints hold no experts)
        self.ep_size: int = self.metadata.get("expert_model_parallel_size", 1)
        self._handles: dict[str, Any] = {}
        self._saved_optimizer: tuple[dict, set[str]] | None = None
        records: dict[str, dict[str, Any]] = {}
        for pp_rank in range(self.pp_size):
            records.update(self._checked_records(self.path("model", 0, pp_rank), pp_rank))
            expert_path = self.path("model", 0, pp_rank, 0)
            if self._saved(expert_path):  # a stage may hold no experts
                records.update(self._checked_records(expert_path, pp_rank))
        # checkpoint name -> record, in model order (an interleaved pipeline's stages hold layers out of order)
        self.params: dict[str, dict[str, Any]] = {
            name: records[name] for name in sorted(records, key=module_order)
        }

    def _checked_records(self, path: str, pp_rank: int) -> dict[str, dict[str, Any]]:
        """The sharding records a stage's first shard file carries, each checked against the tensor the file
        holds under that name (its shape is the record's global shape cut for the saved TP size)."""
        handle = self._handle(path)
        try:
            records = json.loads((handle.metadata() or {}).get("sharding", "{}"))
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{path}: its sharding record is not JSON ({error})") from error
        if not isinstance(records, dict):
            raise CheckpointError(f"{path}: its sharding record is not an object")
        held = set(handle.keys())
        for name, record in records.items():
            shape = record.get("global_shape") if isinstance(record, dict) else None
            dim = record.get("partition_dim") if isinstance(record, dict) else None
            ok = (
                name in held
                and isinstance(shape, list)
                and all(isinstance(size, int) and size >= 0 for size in shape)
                and isinstance(dim, int)
                and -1 <= dim < len(shape)
                and isinstance(record.get("partition_stride"), int)
                and record.get("pp_rank") == pp_rank
            )
            tp_size, ep_size = self._saved_cut(record) if ok else (0, 0)
            ok = ok and tp_size >= 1 and ep_size >= 1
            if ok:
                local = list(shape)
                if dim >= 0:
                    local[dim] //= tp_size
                local[0] //= ep_size
                ok = list(handle.get_slice(name).get_shape()) == local
            if not ok:
                raise CheckpointError(
                    f"{path}: the sharding record of {name!r} ({record!r:.120}) does not describe the tensor the "
                    "file holds; the checkpoint is damaged"
                )
        return records

    def _saved_cut(self, record: dict) -> tuple[int, int]:
        """The (TP, EP) sizes a record's tensor was cut for: the checkpoint's TP and no EP, or an MoE expert's
        expert TP and EP (0 where the record holds no size)."""
        if "ep_size" not in record:
            return self.tp_size, 1
        sizes = (record.get("tp_size"), record.get("ep_size"))
        return tuple(s if isinstance(s, int) and not isinstance(s, bool) and s >= 1 else 0 for s in sizes)

    def _saved(self, path: str) -> bool:
        """Whether the save wrote `path` (listed in metadata.json; checkpoints without file records: on disk)."""
        if "files" not in self.metadata:
            return os.path.exists(path)
        return os.path.relpath(path, self.iteration_dir) in self.metadata["files"]

    def path(self, kind: str, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
        """`kind` is "model" or "optimizer"; with `ep_rank`, the file of those experts (`tp_rank`: expert TP)."""
        return os.path.join(
            model_shard_dir(self.iteration_dir, tp_rank, pp_rank, self.pp_size, ep_rank),
            f"{kind}.safetensors",
        )

    def _handle(self, path: str) -> Any:
        if path not in self._handles:
            self._handles[path] = self.files.open_tensors(path)
        return self._handles[path]

    def _read(self, path: str, name: str) -> torch.Tensor:
        handle = self._handle(path)
        self.files.verify(path)
        try:
            return handle.get_tensor(name)
        except SafetensorError as error:
            raise CheckpointError(
                f"checkpoint file {path} holds no tensor {name!r} ({error}); the files of "
                f"{self.iteration_dir} do not belong together: load another iteration"
            ) from error

    def _shard(
        self, name: str, kind: str, tp_rank: int, pp_rank: int, ep_rank: int | None = None
    ) -> torch.Tensor:
        """One saved TP shard of a tensor, from the file of (`tp_rank`, `pp_rank`[, `ep_rank`])."""
        return self._read(self.path(kind, tp_rank, pp_rank, ep_rank), name)

    def _record(self, param: str) -> dict[str, Any]:
        if param not in self.params:
            raise CheckpointError(
                f"{self.iteration_dir} holds no weight {param!r} (it holds {list(self.params)[:5]}...); the "
                "checkpoint was saved from a different model"
            )
        return self.params[param]

    def sharding(self, name: str, kind: str = "model") -> TensorSharding:
        """How a tensor (optimizer tensors: `<param>.<state>`, split like their param) is cut across TP."""
        record = self._record(param_of(name, kind))
        return sharding_of(record)

    def _repads(self, name: str, kind: str, padded_vocab_size: int) -> bool:
        param = param_of(name, kind)
        return param in VOCAB_PARAMS and self._record(param)["global_shape"][0] != padded_vocab_size

    def is_expert(self, name: str, kind: str = "model") -> bool:
        """Whether a tensor (or an optimizer tensor's param) is an MoE expert weight."""
        return "ep_size" in self._record(param_of(name, kind))

    def global_tensor(
        self, name: str, kind: str = "model", padded_vocab_size: int | None = None
    ) -> torch.Tensor:
        """A whole tensor, its TP shards merged (an expert weight's: every EP rank's experts); given
        `padded_vocab_size`, its vocabulary padding re-cut."""
        sharding = self.sharding(name, kind)
        record = self._record(param_of(name, kind))
        pp_rank = record["pp_rank"]
        if "ep_size" in record:
            tp_ranks = range(record["tp_size"]) if sharding.is_split else [0]
            return merge_expert_shards(
                [
                    merge_tp_shards([self._shard(name, kind, r, pp_rank, e) for r in tp_ranks], sharding)
                    for e in range(record["ep_size"])
                ]
            )
        tp_ranks = range(self.tp_size) if sharding.is_split else [0]
        tensor = merge_tp_shards([self._shard(name, kind, r, pp_rank) for r in tp_ranks], sharding)
        if padded_vocab_size is not None and self._repads(name, kind, padded_vocab_size):
            # weights and fp32 main params copy the last row, Adam moments start at zero
            tensor = resize_vocab(tensor, padded_vocab_size, kind == "model" or name.endswith(".main_param"))
        return tensor

    def tensor_for(
        self,
        name: str,
        kind: str,
        tp_size: int,
        tp_rank: int,
        padded_vocab_size: int,
        experts: ExpertLayout | None = None,
    ) -> torch.Tensor:
        """TP rank `tp_rank`'s slice (of `tp_size`) of a tensor, the vocabulary padded to `padded_vocab_size`; of an
        MoE expert weight, the slice `experts` says (default one rank holding every expert)."""
        sharding = self.sharding(name, kind)
        record = self._record(param_of(name, kind))
        if "ep_size" in record:
            experts = experts or ExpertLayout()
            if (experts.ep_size, experts.etp_size) == (record["ep_size"], record["tp_size"]):
                ep_rank, etp_rank = experts.ep_rank, experts.etp_rank if sharding.is_split else 0
                return self._shard(name, kind, etp_rank, record["pp_rank"], ep_rank)  # the saved cut
            return split_expert_tensor(self.global_tensor(name, kind), sharding, experts, name)
        if sharding.is_split and tp_size == self.tp_size and not self._repads(name, kind, padded_vocab_size):
            pp_rank = self._record(param_of(name, kind))["pp_rank"]
            return self._shard(name, kind, tp_rank, pp_rank)  # the saved cut: one shard
        return split_tp_shard(
            self.global_tensor(name, kind, padded_vocab_size), sharding, tp_size, tp_rank, name
        )

    def optimizer_json_paths(self) -> list[str]:
        """Each stage's optimizer.json, and each expert folder's (their entries: the experts' params)."""
        dense = [
            os.path.join(model_shard_dir(self.iteration_dir, 0, pp_rank, self.pp_size), "optimizer.json")
            for pp_rank in range(self.pp_size)
        ]
        experts = [
            os.path.join(
                model_shard_dir(self.iteration_dir, 0, pp_rank, self.pp_size, ep_rank), "optimizer.json"
            )
            for pp_rank in range(self.pp_size)
            for ep_rank in range(self.ep_size)
        ]
        return dense + [
            path for path in experts if self._saved(os.path.join(os.path.dirname(path), "model.safetensors"))
        ]

    def has_optimizer_state(self) -> bool:
        return all(os.path.exists(path) for path in self.optimizer_json_paths())

    def require_optimizer_state(self) -> None:
        """Refuse to load an optimizer from a checkpoint saved without its state, naming the missing file."""
        missing = [path for path in self.optimizer_json_paths() if not os.path.exists(path)]
        if missing:
            raise CheckpointError(
                f"{missing[0]} is missing (saved with --no-save-optim?); pass --no-load-optim to load the "
                "weights with a fresh optimizer"
            )

    @property
    def optimizer_source(self) -> str:
        """What to name in an error about the optimizer state."""
        return self.optimizer_json_paths()[0]

    def restore_rng_state(self, our_layout: tuple[int, int, int]) -> None:
        """Every rank's RNG states, when (TP, PP, CP) is the saved one (`rng.load_rng_state`)."""
        saved_layout = (self.tp_size, self.pp_size, self.metadata.get("context_parallel_size", 1))
        load_rng_state(self.files, self.metadata, saved_layout, our_layout)

    def _optimizer_meta(self) -> tuple[dict, set[str]]:
        """Every stage's optimizer.json merged (per-param entries are keyed by checkpoint name), and the
        names of the optimizer tensors saved."""
        if self._saved_optimizer is None:
            stages = [self.files.read_json(path) for path in self.optimizer_json_paths()]
            meta = {**stages[0], "param_names": [], "scalars": {}, "tensor_states": {}}
            tensor_names: set[str] = set()
            for json_path, stage in zip(self.optimizer_json_paths(), stages, strict=True):
                meta["param_names"] += stage["param_names"]
                meta["scalars"].update(stage["scalars"])
                meta["tensor_states"].update(stage["tensor_states"])
                path = os.path.join(os.path.dirname(json_path), "optimizer.safetensors")
                if os.path.exists(path):
                    tensor_names.update(self._handle(path).keys())
            self._saved_optimizer = meta, tensor_names
        return self._saved_optimizer

    def optimizer_tensor_names(self, names: dict[str, str]) -> dict[str, str]:
        """{`<key>.<state>`: `<checkpoint name>.<state>`} for every optimizer tensor saved for the params
        `names` (key -> checkpoint name)."""
        saved, tensor_names = self._optimizer_meta()
        return {
            f"{key}.{state_name}": f"{name}.{state_name}"
            for key, name in names.items()
            for state_name in [*saved["tensor_states"].get(name, []), "main_param"]
            if f"{name}.{state_name}" in tensor_names
        }

    def optimizer_meta_for(self, names: dict[str, str]) -> dict:
        """The JSON part of the optimizer's `state_dict()` for the params `names`, keyed by `key`."""
        saved, _ = self._optimizer_meta()
        return {
            **saved,
            "param_names": list(names),
            "scalars": {
                key: saved["scalars"][name] for key, name in names.items() if name in saved["scalars"]
            },
            "tensor_states": {
                key: saved["tensor_states"][name]
                for key, name in names.items()
                if name in saved["tensor_states"]
            },
        }
