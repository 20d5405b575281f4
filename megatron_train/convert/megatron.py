"""The `megatron` loader and saver: Megatron-LM's legacy `torch` checkpoint format.

    <dir>/latest_checkpointed_iteration.txt            an iteration number, or "release"
    <dir>/iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt   (or release/...) one (TP, PP) rank's torch.save

A file holds {"args": argparse.Namespace, "checkpoint_version", "iteration", "model": state dict, optimizer and
RNG state}. Model names are Megatron-Core's (ours; TransformerEngine's fused `layer_norm_weight` names too) with
layer numbers local to the pipeline stage (GPT's `decoder.layers`, BERT's `encoder.layers`), or, in the released
GPT-345M and BERT-345M files, the older nested `language_model.*` names (docs/architecture.md, checkpoints). Reading a pickle could run code, so files load with
`weights_only=True` and only the few classes these files hold (`ALLOWED_GLOBALS`); a file naming any other is
refused before it is unpickled.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import io
import itertools
import logging
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.dtypes import UInt32DType

from megatron_train.arguments import MegatronConfig
from megatron_train.checkpointing import TRACKER_FILENAME, CheckpointError, checkpoint_dir, model_shard_dir
from megatron_train.checkpointing.dcp import CHECKPOINT_VERSION, TE_NAMES
from megatron_train.checkpointing.dcp import megatron_args as megatron_args_of
from megatron_train.checkpointing.layout import (
    OUTPUT_WEIGHT,
    WORD_EMBEDDING,
    TensorSharding,
    merge_expert_shards,
    merge_tp_shards,
    split_tp_shard,
    stage_tensor_names,
)
from megatron_train.convert.checks import check_fields, check_layers, check_positive_ints
from megatron_train.convert.target import output_folder
from megatron_train.convert.tokenizer_files import copy_tokenizer, tokenizer_sources
from megatron_train.convert.weights import (
    ModelWeights,
    check_tensor_names,
    model_shapes,
    model_shardings,
    pad_vocab,
    padded_size_of,
    padded_vocab_for_layout,
    trim_vocab,
)
from megatron_train.data.config import DataConfig
from megatron_train.families.family import MegatronNames, ModelFamily
from megatron_train.models.config import TransformerConfig
from megatron_train.training.config import TokenizerConfig
from storage.atomic import atomic_path, atomic_write_text

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "model_optim_rng.pt"
MARKER_BYTES = 64  # what is read of latest_checkpointed_iteration.txt


class MegatronEnum:
    """Stands in for the Megatron enums `args` holds (args.model_type, args.attention_backend, CUDA-graph scopes;
    an enum unpickles as `Class(value)`): keeps the value, runs nothing."""

    def __init__(self, value: Any) -> None:
        self.value = value


# What Megatron's files hold beyond tensors and containers: args, TE's extra state, numpy RNG states.
ALLOWED_GLOBALS: list[Any] = [
    argparse.Namespace,
    io.BytesIO,
    bytes,
    np.ndarray,
    np.dtype,
    UInt32DType,
    (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    np._core.multiarray._reconstruct,
    (MegatronEnum, "megatron.core.enums.ModelType"),
    (MegatronEnum, "megatron.core.transformer.enums.AttnBackend"),
    (MegatronEnum, "megatron.core.transformer.enums.CudaGraphModule"),
    (MegatronEnum, "megatron.core.transformer.enums.InferenceCudaGraphScope"),
]
_ALLOWED_NAMES = {
    entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"
    for entry in ALLOWED_GLOBALS
}

# The older Megatron-LM GPT and BERT (`language_model.*`, checkpoint_version < 3) -> Megatron-Core names; `{stack}`
# is the layer stack, `decoder` (GPT) or `encoder` (BERT).
_LEGACY_NAMES = [
    (r"language_model\.embedding\.", "embedding."),
    (r"language_model\.output_layer\.", "output_layer."),
    (r"language_model\.pooler\.", "pooler."),
    (r"language_model\.(encoder|transformer)\.final_(layer)?norm\.", "{stack}.final_layernorm."),
    (r"language_model\.(encoder|transformer)\.layers\.", "{stack}.layers."),
    (r"\.(self_attention|attention)\.query_key_value\.", ".self_attention.linear_qkv."),
    (r"\.(self_attention|attention)\.dense\.", ".self_attention.linear_proj."),
    (r"\.post_attention_(layer)?norm\.", ".pre_mlp_layernorm."),
    (r"\.input_norm\.", ".input_layernorm."),
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.linear_fc1."),
    (r"\.mlp\.dense_4h_to_h\.", ".mlp.linear_fc2."),
    (r"^lm_head\.layernorm\.", "lm_head.layer_norm."),
    (r"^lm_head\.bias$", "output_layer.bias"),
]
# What a checkpoint's args must give: the model's shape, the padded vocabulary and the layout it was saved from.
REQUIRED_ARGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "padded_vocab_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
)
TIED_COPY = "output_layer.weight (the tied copy)"  # where the loader keeps a tied model's last-stage copy
_LOCAL_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.*)$")


def read_checkpoint_file(path: str) -> dict[str, Any]:
    """One rank's file, unpickled with `weights_only=True` and the allow-list (`read_allowed_pickle`)."""
    if not os.path.exists(path):
        raise CheckpointError(
            f"Megatron checkpoint file {path} is missing: the save is incomplete or was moved"
        )
    if not os.path.isfile(path):  # a FIFO or a device would block the read or never end it
        raise CheckpointError(f"Megatron checkpoint file {path} is not a regular file; the save is damaged")
    return read_allowed_pickle(path, path)


def read_allowed_pickle(source: str | io.BytesIO, where: str) -> Any:
    """A torch.save'd object (a file or its bytes) unpickled with `weights_only=True` and the allow-list; any
    other class is refused by name before a byte is unpickled, so a crafted checkpoint runs nothing."""
    try:
        refused = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(source)) - _ALLOWED_NAMES)
        if isinstance(source, io.BytesIO):
            source.seek(0)
        if not refused:
            with torch.serialization.safe_globals(ALLOWED_GLOBALS):
                return torch.load(source, map_location="cpu", weights_only=True)
    except (RuntimeError, ValueError, OSError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile) as error:
        raise CheckpointError(
            f"{where} is not a complete torch.save file (truncated or damaged: "
            f"{str(error).splitlines()[0].split('. ')[0][:200]}): copy it again from where Megatron-LM saved it, or "
            "load another iteration"
        ) from error
    raise CheckpointError(
        f"{where} holds pickled objects of {refused}, outside the classes a Megatron checkpoint holds "
        f"({sorted(_ALLOWED_NAMES)}); unpickling them could run code, so it is not loaded"
    )


def find_iteration_dir(load_dir: str, iteration: int | None) -> tuple[str, int]:
    """(folder, number) of `iteration`, else of the latest marker (a number or "release", as Megatron writes)."""
    if iteration is not None:
        return checkpoint_dir(load_dir, iteration), iteration
    tracker = os.path.join(load_dir, TRACKER_FILENAME)
    if not os.path.isdir(load_dir):
        raise CheckpointError(
            f"{load_dir} does not exist: pass the folder Megatron-LM saved its checkpoints to"
        )
    if not os.path.exists(tracker):
        raise CheckpointError(f"{load_dir} holds no {TRACKER_FILENAME}: pass --iteration")
    with open(tracker, "rb") as handle:  # a number: a few bytes (a larger file is not a marker)
        text = handle.read(MARKER_BYTES).decode("utf-8", errors="replace").strip()
    if text == "release":
        return os.path.join(load_dir, "release"), 0
    if not text.isdigit():
        raise CheckpointError(
            f"{tracker} should hold an iteration number or 'release' but holds {text[:40]!r}"
        )
    return checkpoint_dir(load_dir, int(text)), int(text)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested legacy state dict ({"language_model": {"embedding": {...}}}) with dotted names."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat


def _legacy_qkv(tensor: torch.Tensor, version: float, heads: int, where: str) -> torch.Tensor:
    """Megatron's fix_query_key_value_ordering: versions 0 ([3, heads, d]) and 1 ([heads, d, 3]) of one TP
    shard's fused QKV -> [heads, 3, d], Megatron-Core's layout for one query group per head."""
    if version in (0, 1) and (
        not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[0] % (3 * heads)
    ):
        raise CheckpointError(
            f"{where}: a fused QKV tensor of shape {list(getattr(tensor, 'shape', []))} does not hold 3 x {heads} "
            "heads (args num_attention_heads / tensor_model_parallel_size); the args and the weights disagree"
        )
    rest = tensor.shape[1:]
    if version == 0:
        return tensor.view(3, heads, -1, *rest).transpose(0, 1).reshape(tensor.shape)
    if version == 1:
        return tensor.view(heads, -1, 3, *rest).transpose(1, 2).reshape(tensor.shape)
    return tensor


def _our_names(
    state: dict[str, Any], version: float, local_heads: int, names: MegatronNames, where: str
) -> dict[str, torch.Tensor]:
    """One rank's model state under our names (layer numbers still local); TE extra state dropped. The older
    names are renamed only in an older model's state (one holding `language_model`); the family's own
    (`MegatronNames.renames`) after TransformerEngine's."""
    tensors = {}
    renames = _LEGACY_NAMES if "language_model" in state else []
    for name, value in _flatten(state).items():
        if name.endswith("_extra_state") or value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{where}: {name} is a {type(value).__name__}, not a tensor")
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement.format(stack=names.layer_stack), name)
        for theirs, ours in (*TE_NAMES.items(), *names.renames.items()):
            name = name.replace(theirs, ours)
        if name.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")):
            value = _legacy_qkv(value, version, local_heads, where)
        tensors[name] = value
    return tensors


# Megatron-Core's MoE experts in its state dicts, one Linear per expert (`[out, in]`), under `<layer>.mlp.experts.`:
# SequentialMLP's `local_experts.<j>.linear_fc1.weight`, TransformerEngine's grouped `linear_fc1.weight<j>` (j the
# expert's index on its EP rank); and the legacy GroupedMLP's `weight1` [h, local experts x fc1] / `weight2`.
_SEQUENTIAL_EXPERT = re.compile(
    r"^(.*\.mlp\.experts\.)(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$"
)
_GROUPED_EXPERTS = re.compile(r"^(.*\.mlp\.experts\.)(weight[12])$")
EXPERT_WEIGHTS = {"linear_fc1": "weight1", "linear_fc2": "weight2"}


def expert_linear_sharding(linear: str, model: TransformerConfig) -> TensorSharding:
    """How Megatron splits one expert's Linear over (expert) TP: fc1 column-parallel ([gate; up] with SwiGLU),
    fc2 row-parallel."""
    return TensorSharding(0, 2 if model.swiglu else 1) if linear == "linear_fc1" else TensorSharding(1)


def experts_from_linears(linears: list[torch.Tensor]) -> torch.Tensor:
    """Our stacked expert weight ([experts, in, out], grouped_mm's layout) from every expert's Linear [out, in]."""
    return torch.stack(linears).transpose(1, 2).contiguous()


def experts_to_linears(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `experts_from_linears`."""
    return [expert.t().contiguous() for expert in tensor]


def is_expert_name(name: str) -> bool:
    """Whether a rank's tensor (its name from `LegacyCheckpoint.rank_tensors`) is an MoE expert's."""
    return bool(_SEQUENTIAL_EXPERT.match(name) or _GROUPED_EXPERTS.match(name))


@dataclass
class ExpertShards:
    """The expert tensors of every (TP, EP) rank of one stage set, gathered to be merged into our stacked expert
    weights: SequentialMLP's (or TE's) per-expert Linears by layer, Linear and global expert index, the legacy
    GroupedMLP's weights by layer, weight and EP rank (in our per-rank layout already)."""

    local_experts: int  # experts per EP rank
    per_expert: dict[tuple[str, str], dict[int, list[torch.Tensor]]] = dataclasses.field(default_factory=dict)
    grouped: dict[tuple[str, str], dict[int, list[torch.Tensor]]] = dataclasses.field(default_factory=dict)

    def add(self, name: str, tensor: torch.Tensor, ep_rank: int) -> str | None:
        """Files one TP shard of an EP rank's expert tensor (TP ranks in order); the name of our weight it goes to,
        or None for a tensor that is not an expert's."""
        expert, group = _SEQUENTIAL_EXPERT.match(name), _GROUPED_EXPERTS.match(name)
        if expert:  # an EP rank's expert j is expert ep_rank * local experts + j of the layer
            index = ep_rank * self.local_experts + int(expert[2] if expert[2] is not None else expert[5])
            linear = expert[3] or expert[4]
            self.per_expert.setdefault((expert[1], linear), {}).setdefault(index, []).append(tensor)
            return expert[1] + EXPERT_WEIGHTS[linear]
        if group:
            ranks = self.grouped.setdefault((group[1], group[2]), {})
            ranks.setdefault(ep_rank, []).append(_grouped_to_ours(tensor, group[2], self.local_experts))
            return group[1] + group[2]
        return None

    def merged(
        self, model: TransformerConfig, shardings: dict[str, TensorSharding]
    ) -> dict[str, torch.Tensor]:
        """Our expert weights: each expert's (or EP rank's) TP shards merged, the experts stacked."""
        tensors = {}
        for (prefix, linear), experts in self.per_expert.items():
            sharding = expert_linear_sharding(linear, model)
            linears = [merge_tp_shards(experts[e], sharding) for e in sorted(experts)]
            tensors[prefix + EXPERT_WEIGHTS[linear]] = experts_from_linears(linears)
        for (prefix, weight), ranks in self.grouped.items():
            name = prefix + weight
            tensors[name] = merge_expert_shards(
                [merge_tp_shards(ranks[r], shardings.get(name, TensorSharding())) for r in sorted(ranks)]
            )
        return tensors


def _grouped_to_ours(tensor: torch.Tensor, weight: str, local_experts: int) -> torch.Tensor:
    """A GroupedMLP weight of one rank as our [local experts, in, out]: weight1 [h, experts x fc1] -> [experts,
    h, fc1]; weight2 [experts x ffn, h] -> [experts, ffn, h]."""
    if weight == "weight1":
        return tensor.view(tensor.shape[0], local_experts, -1).transpose(0, 1).contiguous()
    return tensor.view(local_experts, -1, tensor.shape[1])


def checked_args(args: Any, where: str) -> argparse.Namespace:
    """Megatron's pickled args, refused unless they give the model's shape and the saved layout."""
    missing = [name for name in REQUIRED_ARGS if getattr(args, name, None) is None]
    if not isinstance(args, argparse.Namespace) or missing:
        raise CheckpointError(
            f"{where}: its args lack {missing or REQUIRED_ARGS} (a {type(args).__name__}): the model's shape is "
            "unknown; this is not a Megatron-LM training checkpoint, or it was saved without its args"
        )
    return args


# The args (besides the model's and tokenizer's settings) a loader reads: each an integer of at least 1.
LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "padded_vocab_size")


def check_model_args(args: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the tokenizer's settings of Megatron's args, each checked (types, sizes, the layout's
    divisions, a recorded true_vocab_size the padding can hold), naming `where` and the field."""
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{where}: args is a {type(args).__name__}, not Megatron's argparse.Namespace")
    given = vars(args)
    if "layernorm_epsilon" in given and "norm_epsilon" not in given:
        given = {**given, "norm_epsilon": given["layernorm_epsilon"]}
    if given.get("moe_token_dispatcher_type") not in (None, "allgather", "alltoall"):
        given = {**given, "moe_token_dispatcher_type": "alltoall"}
    if isinstance(given.get("moe_layer_freq"), int | list):  # Megatron's args hold the pattern evaluated
        given = {**given, "moe_layer_freq": str(given["moe_layer_freq"])}

    def section(cls: type) -> dict[str, Any]:
        values = {f.name: given[f.name] for f in dataclasses.fields(cls) if given.get(f.name) is not None}
        check_fields(values, cls, f"{where} (args)")
        return values

    model = section(TransformerConfig)
    tokenizer = section(TokenizerConfig)
    check_positive_ints(given, LAYOUT_ARGS, f"{where} (args)")
    for field in ("num_layers", "hidden_size", "num_attention_heads"):
        if field not in model:
            raise CheckpointError(f"{where} (args): no {field}; the model's shape is unknown")
    tp = given["tensor_model_parallel_size"]
    for field, parallel in (("num_attention_heads", "tensor_model_parallel_size"),
                            ("num_layers", "pipeline_model_parallel_size")):  # fmt: skip
        if model[field] % given[parallel]:
            raise CheckpointError(
                f"{where} (args): {field} {model[field]} is not divisible by {parallel} {given[parallel]}"
            )
    if given.get("expert_model_parallel_size") is not None:
        check_positive_ints(given, ("expert_model_parallel_size",), f"{where} (args)")
        if model.get("num_experts", 1) % given["expert_model_parallel_size"]:
            raise CheckpointError(
                f"{where} (args): num_experts {model['num_experts']} is not divisible by "
                f"expert_model_parallel_size {given['expert_model_parallel_size']}"
            )
    padded, multiple = given["padded_vocab_size"], tokenizer.get("make_vocab_size_divisible_by", 128) * tp
    recorded = given.get("true_vocab_size")
    if recorded is not None and not padded - multiple < recorded <= padded:
        raise CheckpointError(
            f"{where} (args): true_vocab_size is {recorded}, but padded_vocab_size {padded} holds a tokenizer of "
            f"{max(padded - multiple + 1, 1)} to {padded} tokens; the args are not the checkpoint's own"
        )
    return model, tokenizer


def config_from_args(args: Any, true_vocab_size: int | None, where: str) -> MegatronConfig:
    """Our config from Megatron's args (the same names, checked by `check_model_args`), the vocabulary from
    --true-vocab-size or the args."""
    model, tokenizer = check_model_args(args, where)
    given = vars(args)
    recorded = given.get("true_vocab_size")
    true_vocab_size = true_vocab_size or recorded
    if true_vocab_size is None:
        true_vocab_size = given["padded_vocab_size"]
        logger.warning(
            "%s does not record its tokenizer's vocabulary size: all %d padded rows are kept as tokens; pass "
            "--true-vocab-size (GPT-2's tokenizer: 50257) to cut the padding", where, true_vocab_size,
        )  # fmt: skip
    if true_vocab_size > given["padded_vocab_size"]:
        raise ValueError(
            f"--true-vocab-size {true_vocab_size} exceeds the {given['padded_vocab_size']} vocabulary rows of "
            f"{where} (args padded_vocab_size): pass the size of its tokenizer"
        )
    model["true_vocab_size"] = true_vocab_size
    try:
        model_config = TransformerConfig(**model)
    except ValueError as error:
        raise CheckpointError(f"{where} (args): {error}") from error
    return MegatronConfig(model=model_config, data=DataConfig(), tokenizer=TokenizerConfig(**tokenizer))


@dataclass
class LegacyCheckpoint:
    """One iteration of a Megatron-LM `torch` checkpoint with every (TP, PP, EP) rank's file read (an MoE model's
    EP ranks each hold their experts and a copy of the dense weights)."""

    iteration_dir: str
    iteration: int
    args: argparse.Namespace
    version: float  # Megatron's checkpoint_version: 3 for Megatron-Core models
    files: dict[tuple[int, int, int], dict[str, Any]]  # (tp_rank, pp_rank, ep_rank) -> what that rank saved

    @property
    def ep_size(self) -> int:
        return expert_parallel_size(self.args)

    @property
    def local_experts(self) -> int:
        """Experts per EP rank (1 for a dense model)."""
        return (getattr(self.args, "num_experts", None) or self.ep_size) // self.ep_size

    def ranks(self) -> itertools.product:
        """Every (pp_rank, ep_rank, tp_rank) whose file the checkpoint holds, TP fastest."""
        args = self.args
        return itertools.product(
            range(args.pipeline_model_parallel_size),
            range(self.ep_size),
            range(args.tensor_model_parallel_size),
        )

    def path(self, tp_rank: int, pp_rank: int, name: str = CHECKPOINT_FILE, ep_rank: int = 0) -> str:
        """A file of a rank's folder (`distrib_optim.pt` beside `model_optim_rng.pt`)."""
        pp = self.args.pipeline_model_parallel_size
        return os.path.join(rank_dir(self.iteration_dir, tp_rank, pp_rank, pp, ep_rank, self.ep_size), name)

    def model_chunks(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> list[dict[str, Any]]:
        """A rank's model state dicts: one, or one per virtual stage (an interleaved pipeline's model0, ...)."""
        saved = self.files[(tp_rank, pp_rank, ep_rank)]
        if "model" in saved:
            chunks = [saved["model"]]
        else:
            chunks = [
                saved[f"model{i}"] for i in range(sum(1 for key in saved if re.fullmatch(r"model\d+", key)))
            ]
        if not chunks or not all(isinstance(chunk, dict) for chunk in chunks):
            raise CheckpointError(
                f"{self.path(tp_rank, pp_rank, ep_rank=ep_rank)} holds no model state dict ('model' or 'model0', ...)"
            )
        return chunks

    def rank_tensors(
        self, tp_rank: int, pp_rank: int, family: ModelFamily, ep_rank: int = 0
    ) -> list[tuple[str, torch.Tensor]]:
        """A rank's model tensors in the order its file holds them (its parameters' order), under our global
        names (Megatron-LM's files split the layers evenly over the stages); the last stage's copy of a tied
        output layer keeps the name `output_layer.weight`; the stages hold the layers the family's split gives
        them (Megatron-LM's even split, a hybrid pattern's cuts)."""
        names = megatron_names(family, "--loader megatron")
        args = self.args
        chunks = self.model_chunks(tp_rank, pp_rank, ep_rank)
        virtual_size = len(chunks) if len(chunks) > 1 else None
        heads = args.num_attention_heads // args.tensor_model_parallel_size
        where = self.path(tp_rank, pp_rank, ep_rank=ep_rank)
        model = config_from_args(args, args.padded_vocab_size, where).model  # what the family's split reads
        tensors = []
        for virtual_rank, chunk in enumerate(chunks):
            layers = family.pipeline.layer_range(
                model, pp_rank, args.pipeline_model_parallel_size, virtual_rank, virtual_size
            )
            for name, tensor in _our_names(chunk, self.version, heads, names, where).items():
                local = _LOCAL_LAYER.match(name)
                if local:
                    name = f"{local.group(1)}.layers.{layers.start + int(local.group(2))}.{local.group(3)}"
                tensors.append((name, tensor))
        return tensors

    def weights(self, true_vocab_size: int | None, family: ModelFamily) -> ModelWeights:
        """The model of `family` (Megatron's --model-type), its TP shards merged and its stages' layers
        numbered globally; the vocabulary cut to `true_vocab_size` (see `config_from_args`). The args are checked
        against the files (layers, every shard's shape, a tied copy) before the model is built on the meta device
        or the shards merged."""
        args, where = self.args, self.path(0, 0)
        config = config_from_args(args, true_vocab_size, where)
        model, tp = config.model, args.tensor_model_parallel_size
        shards: dict[str, list[torch.Tensor]] = {}
        files: dict[str, str] = {}  # tensor name -> the file of its first shard, for messages
        expert_shards = ExpertShards(self.local_experts)
        for pp_rank, ep_rank, tp_rank in self.ranks():
            for name, tensor in self.rank_tensors(tp_rank, pp_rank, family, ep_rank):
                if expert_shards.add(name, tensor, ep_rank) is not None:
                    continue
                if ep_rank:  # every EP rank's file holds the same dense weights
                    continue
                if name == OUTPUT_WEIGHT and not model.untie_embeddings_and_output_weights:
                    name = TIED_COPY  # the last stage's copy of the tied embedding, checked against it
                shards.setdefault(name, []).append(tensor)
                files.setdefault(name, self.path(tp_rank, pp_rank))
        stack = f"{megatron_names(family, '--loader megatron').layer_stack}.layers."
        check_layers(model.num_layers, shards, stack, "args.num_layers", where, self.iteration_dir)
        shardings = model_shardings(config, args.padded_vocab_size, family, where)
        tied_copy = shards.pop(TIED_COPY, None)
        experts = expert_shards.merged(model, shardings)
        check_tensor_names({**shards, **experts}, list(shardings), self.iteration_dir)
        expected = model_shapes(config, args.padded_vocab_size, family)
        _check_shard_shapes(shards, files, expected, shardings, tp)
        for name, tensor in experts.items():
            if tuple(tensor.shape) != expected[name]:
                raise CheckpointError(
                    f"{self.iteration_dir}: the experts of {name} make a tensor of shape {list(tensor.shape)}, but "
                    f"the args (num_experts, moe_ffn_hidden_size, expert_model_parallel_size, ...) make it "
                    f"{list(expected[name])}; the args and the weights come from different models"
                )
        tensors = {name: merge_tp_shards(parts, shardings[name]) for name, parts in shards.items()} | experts
        if tied_copy is not None and not _same(merge_tp_shards(tied_copy, shardings[WORD_EMBEDDING]),
                                               tensors[WORD_EMBEDDING]):  # fmt: skip
            raise CheckpointError(
                f"{where} (args): untie_embeddings_and_output_weights is False (a tied output layer), but the "
                f"output_layer.weight of {files[TIED_COPY]} is not the embedding; the args are not the checkpoint's "
                "own"
            )
        return ModelWeights(
            config,
            trim_vocab(tensors, model.true_vocab_size),
            tokenizer_sources(config.tokenizer, os.path.dirname(self.iteration_dir)),
            self.iteration,
            family=family,
        )


def expert_parallel_size(args: argparse.Namespace) -> int:
    """Megatron's args' expert_model_parallel_size (older args: none, 1)."""
    return getattr(args, "expert_model_parallel_size", None) or 1


def _check_rank_folders(iteration_dir: str, tp: int, pp: int, ep: int, where: str) -> None:
    """The args' (TP, PP, EP) against the rank folders there, before a file is opened."""
    folders = sorted(name for name in os.listdir(iteration_dir) if name.startswith("mp_rank_"))
    if len(folders) != tp * pp * ep:
        experts = f" x expert_model_parallel_size {ep}" if ep > 1 else ""
        raise CheckpointError(
            f"{where} (args): tensor_model_parallel_size {tp} x pipeline_model_parallel_size {pp}{experts} = "
            f"{tp * pp * ep} ranks, but {iteration_dir} holds {len(folders)} rank folders ({', '.join(folders[:4])}"
            f"{', ...' if len(folders) > 4 else ''})"
        )


def open_checkpoint(load_dir: str, iteration: int | None = None) -> LegacyCheckpoint:
    """`load_dir`'s iteration (latest, or `iteration`) with every rank's file read; the args are checked (types,
    sizes, the rank folders they imply) before the other ranks' files are opened."""
    iteration_dir, number = find_iteration_dir(load_dir, iteration)
    without_pp = os.path.join(model_shard_dir(iteration_dir, 0, 0, 1), CHECKPOINT_FILE)
    first_path = (
        without_pp
        if os.path.exists(without_pp)
        else os.path.join(model_shard_dir(iteration_dir, 0, 0, 2), CHECKPOINT_FILE)
    )
    first = read_checkpoint_file(first_path)
    if not isinstance(first, dict) or "args" not in first:
        raise CheckpointError(
            f"{first_path} holds no args (saved with --no-save-args?): its model's shape is unknown; re-save it "
            "with Megatron-LM's args, or load it there and save again"
        )
    args = checked_args(first["args"], first_path)
    check_model_args(args, first_path)
    tp, pp, ep = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        expert_parallel_size(args),
    )
    _check_rank_folders(iteration_dir, tp, pp, ep, first_path)
    version = first.get("checkpoint_version", 0)
    if not isinstance(version, int | float) or isinstance(version, bool):
        raise CheckpointError(f"{first_path}: checkpoint_version is {version!r}, not a number")
    files = {}
    for pp_rank, ep_rank, tp_rank in itertools.product(range(pp), range(ep), range(tp)):
        path = os.path.join(rank_dir(iteration_dir, tp_rank, pp_rank, pp, ep_rank, ep), CHECKPOINT_FILE)
        saved = first if (tp_rank, pp_rank, ep_rank) == (0, 0, 0) else read_checkpoint_file(path)
        if not isinstance(saved, dict):
            raise CheckpointError(f"{path} holds a {type(saved).__name__}, not a Megatron checkpoint's dict")
        files[(tp_rank, pp_rank, ep_rank)] = saved
    return LegacyCheckpoint(iteration_dir, number, args, float(version), files)


def megatron_names(family: ModelFamily, flag: str) -> MegatronNames:
    """The family's names in Megatron-LM's checkpoints; a family without them is refused naming `flag`."""
    if family.megatron_names is None:
        raise ValueError(
            f"{flag}: the {family.name} family has no Megatron-LM checkpoint names here; convert it to or from "
            "flow (or hf)"
        )
    return family.megatron_names


def load(
    load_dir: str, iteration: int | None, true_vocab_size: int | None, family: ModelFamily
) -> ModelWeights:
    """The model of `family` (Megatron's --model-type) in a Megatron-LM checkpoint, its TP shards merged and its
    stages' layers numbered globally."""
    return open_checkpoint(load_dir, iteration).weights(true_vocab_size, family)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _check_shard_shapes(
    shards: dict[str, list[torch.Tensor]],
    files: dict[str, str],
    expected: dict[str, tuple[int, ...]],
    shardings: dict[str, TensorSharding],
    tp: int,
) -> None:
    """Each TP shard has its part of the shape the args imply, before the shards are merged."""
    for name, parts in shards.items():
        shape = list(expected[name])
        if shardings[name].is_split:
            shape[shardings[name].partition_dim] //= tp
        for part in parts:
            if list(part.shape) != shape:
                raise CheckpointError(
                    f"{files[name]}: {name} has shape {list(part.shape)}, but the args (hidden_size, "
                    f"num_attention_heads, ffn_hidden_size, padded_vocab_size, ...) make each of its "
                    f"{len(parts)} shard(s) {shape}; the args and the weights come from different models"
                )


def rank_dir(iteration_dir: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int, ep_size: int) -> str:
    """Megatron's folder of one rank's file: mp_rank_<tp>[_<pp>][_<ep>] (EP only when above 1)."""
    folder = model_shard_dir(iteration_dir, tp_rank, pp_rank, pp_size)
    return folder + f"_{ep_rank:03d}" if ep_size > 1 else folder


def megatron_args(weights: ModelWeights, tp: int, pp: int, padded_vocab_size: int) -> argparse.Namespace:
    """Megatron's args for the saved model (`checkpointing.dcp.megatron_args`)."""
    return megatron_args_of(weights.config, tp, pp, padded_vocab_size, weights.iteration)


def save_torch(value: Any, path: str) -> None:
    """torch.save to `path` atomically; a failed write (torch's RuntimeError names no cause) is an OSError
    naming the file, which the saver's `output_folder` turns into its one-line error."""
    with atomic_path(path) as tmp:
        try:
            torch.save(value, tmp)
        except RuntimeError as error:  # torch's zip writer: "unexpected pos ...", "file write failed"
            raise OSError(errno.EIO, "torch.save stopped writing it", path) from error


def save(
    weights: ModelWeights, save_dir: str, target_tp: int = 1, target_pp: int = 1, overwrite: bool = False
) -> str:
    """Write `weights` as a Megatron-LM `torch` checkpoint for (target_tp, target_pp), built beside `save_dir`
    and moved into place whole (`convert.target`); returns the iteration folder."""
    config = weights.config
    megatron_names(weights.family, "--saver megatron")
    padded = padded_vocab_for_layout(weights, target_tp, target_pp)
    with output_folder(save_dir, overwrite, padded_size_of(weights, padded)) as out:
        config.tokenizer = copy_tokenizer(config.tokenizer, weights.tokenizer_files, out, save_dir)
        _write(weights, out, target_tp, target_pp, padded)
    return checkpoint_dir(save_dir, weights.iteration)


def _write(weights: ModelWeights, root: str, target_tp: int, target_pp: int, padded: int) -> None:
    """Every rank's model_optim_rng.pt, then the latest marker, into the folder `root`."""
    config = weights.config
    tensors = pad_vocab(weights.tensors, padded)
    shardings = model_shardings(config, padded, weights.family)
    tied = not config.model.untie_embeddings_and_output_weights
    args = megatron_args(weights, target_tp, target_pp, padded)
    iteration_dir = checkpoint_dir(root, weights.iteration)
    split = weights.family.pipeline
    for pp_rank in range(target_pp):
        layers = split.layer_range(config.model, pp_rank, target_pp)
        last = pp_rank == target_pp - 1
        names = stage_tensor_names(split, list(shardings), layers, pp_rank == 0, last)
        for tp_rank in range(target_tp):
            state = {}
            for name in names:
                local = _LOCAL_LAYER.match(name)
                key = (
                    f"{local.group(1)}.layers.{int(local.group(2)) - layers.start}.{local.group(3)}"
                    if local
                    else name
                )
                if key.endswith((".mlp.experts.weight1", ".mlp.experts.weight2")):  # one Linear per expert
                    linear = "linear_fc1" if key.endswith("weight1") else "linear_fc2"
                    sharding = expert_linear_sharding(linear, config.model)
                    for index, weight in enumerate(experts_to_linears(tensors[name])):
                        expert_key = key.rsplit(".", 1)[0] + f".local_experts.{index}.{linear}.weight"
                        state[expert_key] = split_tp_shard(weight, sharding, target_tp, tp_rank, name)
                    continue
                state[key] = split_tp_shard(tensors[name], shardings[name], target_tp, tp_rank, name)
            if tied and last and target_pp > 1:  # Megatron-Core's last stage holds a copy of the embedding
                state[OUTPUT_WEIGHT] = split_tp_shard(
                    tensors[WORD_EMBEDDING], shardings[WORD_EMBEDDING], target_tp, tp_rank
                )
            path = os.path.join(model_shard_dir(iteration_dir, tp_rank, pp_rank, target_pp), CHECKPOINT_FILE)
            save_torch(
                {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": weights.iteration,
                 "model": state, "num_floating_point_operations_so_far": 0},
                path,
            )  # fmt: skip
    atomic_write_text(os.path.join(root, TRACKER_FILENAME), str(weights.iteration))
