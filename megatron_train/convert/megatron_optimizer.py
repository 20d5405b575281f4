"""The Adam state of a Megatron-LM checkpoint under our names, as our optimizer loads it.

Megatron-LM's legacy (`torch`) files keep Adam's state by each parameter's position, not its name
(docs/architecture.md, checkpoints):
- without the distributed optimizer, a rank's `model_optim_rng.pt` holds `optimizer`, torch's Adam state dict
  (`state` by param index, `param_groups` listing each group's indices); with bf16/fp16 it is wrapped as
  {"optimizer", "fp32_from_fp16_params" (the fp32 main params, group by group), "grad_scaler"};
- with `--use-distributed-optimizer`, `optimizer` keeps the param groups only (each with Adam's `step`), and
  `distrib_optim.pt` beside it holds the fp32 main params and Adam moments of the rank's whole gradient buffer,
  gathered over the data-parallel ranks (Megatron-Core's `get_parameter_state_dp_zero`, `buckets_coalesced`).

A rank's params are its model state dict's tensors in order (Megatron-Core walks `named_parameters()`); its groups
split them by weight decay (`wd_mult` 0 for biases and 1-D params: our `no_weight_decay`), each group in model
order, indices numbered group after group. The buffer is laid out as Megatron-Core's `_ParamAndGradBuffer`: params
in reverse order, each start padded to 64 elements, a tied embedding in a bucket of its own under PP, buckets of
--ddp-bucket-size on the first stage with --overlap-grad-reduce, bucket ends padded to lcm(DP, 128). That layout is
checked against the file (its length, and every fp32 main param against the weight it rounds to), so a Megatron
version that lays its buffer out otherwise is refused (`UnmappedOptimizerState`), never misread.

An MoE model's experts have an optimizer of their own when expert DP differs from DP (Megatron-Core's
ChainedOptimizer): `optimizer` and `distrib_optim.pt` then hold a list, the dense params' optimizer and then the
experts' (each its own param indices and gradient buffer, the experts' padded for expert DP); an EP rank's files
hold its experts' state, the dense params' state is EP rank 0's.

`torch_dist` checkpoints keep it by name, in model space (`optimizer.state.<exp_avg|exp_avg_sq|fp32_param|param>.
<model key>`, as Adam and the distributed optimizer's fully_reshardable format save it), with the param groups and
the step in the common state (a ChainedOptimizer's: one entry per optimizer, its tensors under `chained_<i>.` unless
saved with chained_optim_avoid_prefix); the distributed optimizer's buffer-shaped formats (dp_reshardable) are
refused.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from megatron_train.checkpointing.layout import OUTPUT_WEIGHT, WORD_EMBEDDING, TensorSharding, merge_tp_shards
from megatron_train.convert.megatron import (
    ExpertShards,
    LegacyCheckpoint,
    config_from_args,
    expert_parallel_size,
    is_expert_name,
    read_allowed_pickle,
)
from megatron_train.convert.torch_dist import DistCheckpoint
from megatron_train.convert.weights import ModelWeights
from megatron_train.families.family import ModelFamily
from megatron_train.optimizer.optimizer import no_weight_decay

DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"
# What of a Megatron param group our optimizer's groups take (the scheduler sets lr and weight decay each step).
GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay", "wd_mult", "lr_mult")
STATE_TENSORS = ("main", "exp_avg", "exp_avg_sq")
PARAM_ALIGNMENT = 64  # Megatron-Core pads each param's start in the buffer to 64 elements


class UnmappedOptimizerState(ValueError):
    """The optimizer state of a checkpoint that does not map onto ours; the message says why."""


@dataclass
class ParamState:
    """One param's fp32 main copy, Adam moments and step count (one TP rank's shard)."""

    main: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: float


def wd_mult(name: str, tensor: torch.Tensor) -> float:
    return 0.0 if no_weight_decay(name, tensor) else 1.0


def legacy_optimizer_state(
    checkpoint: LegacyCheckpoint, family: ModelFamily, shardings: dict[str, TensorSharding]
) -> tuple[dict[str, torch.Tensor], dict]:
    """(`<param>.<state>` tensors of whole params, the JSON part) as `MegatronOptimizer.state_dict` gives them,
    from every rank's optimizer state; raises UnmappedOptimizerState where it does not map. The dense params'
    state comes from EP rank 0's files, each expert's from the file of the EP rank that holds it, merged into our
    stacked expert tensors as the weights are (`ExpertShards`)."""
    args = checkpoint.args
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    shards: dict[str, list[ParamState]] = {}
    experts = {key: ExpertShards(checkpoint.local_experts) for key in STATE_TENSORS}
    expert_steps: dict[str, float] = {}
    settings: dict[float, dict[str, Any]] = {}
    for pp_rank, ep_rank, tp_rank in checkpoint.ranks():
        states, groups = _rank_states(checkpoint, tp_rank, pp_rank, ep_rank, family)
        where = checkpoint.path(tp_rank, pp_rank, ep_rank=ep_rank)
        for optimizer_groups in groups:
            merge_settings(settings, group_settings(optimizer_groups, where), where)
        for name, param_state in states:
            merged_name = None
            for key in STATE_TENSORS:
                merged_name = experts[key].add(name, getattr(param_state, key), ep_rank)
            if merged_name is not None:
                expert_steps[merged_name] = param_state.step
            elif not (tied and name == OUTPUT_WEIGHT):  # the last stage's copy of the tied embedding
                shards.setdefault(name, []).append(param_state)
    merged = {
        name: ParamState(
            *(
                merge_tp_shards([getattr(part, key) for part in parts], shardings[name])
                for key in STATE_TENSORS
            ),
            parts[0].step,
        )
        for name, parts in shards.items()
    }
    model = config_from_args(args, args.padded_vocab_size, checkpoint.path(0, 0)).model
    stacked = {key: experts[key].merged(model, shardings) for key in STATE_TENSORS}
    for name, step in expert_steps.items():
        merged[name] = ParamState(*(stacked[key][name] for key in STATE_TENSORS), step)
    return optimizer_state_dict(merged, settings)


def dist_optimizer_state(
    checkpoint: DistCheckpoint, weights: ModelWeights
) -> tuple[dict[str, torch.Tensor], dict]:
    """`legacy_optimizer_state` of a torch_dist checkpoint whose optimizer state is saved in model space. A
    ChainedOptimizer's common state holds one entry per optimizer (dense, experts) and its tensors are keyed by
    model key either way (under `chained_<i>.` unless saved with chained_optim_avoid_prefix); Megatron-Core
    synchronises the optimizers' steps before it saves them."""
    where = checkpoint.iteration_dir
    saved = checkpoint.common.get("optimizer")
    if saved is None:
        raise UnmappedOptimizerState(f"{where} holds no optimizer state (saved with --no-save-optim)")
    if isinstance(saved, dict) and saved and all(isinstance(key, int) for key in saved):
        saved = [saved[key] for key in sorted(saved)]  # ChainedOptimizer.sharded_state_dict's form
    optimizers = _chained(saved, where)
    settings: dict[float, dict[str, Any]] = {}
    steps = set()
    for optimizer in optimizers:
        adam = _adam(optimizer, where)
        groups = group_settings(adam["param_groups"], where)
        merge_settings(settings, groups, where)
        common_step = adam.get("state", {}).get("common_step")
        group_steps = {float(group.get("step", 0)) for group in groups.values()}
        steps |= group_steps if common_step is None else {float(common_step)}
    if len(steps) != 1:
        raise UnmappedOptimizerState(
            f"{where}: its optimizers' param groups are at steps {sorted(steps)}; one step is mapped"
        )
    moments = checkpoint.optimizer_tensors()
    if not moments:
        sharding = optimizers[0].get("param_state_sharding_type", "buffers")
        raise UnmappedOptimizerState(
            f"{where}: its optimizer state is saved as {sharding}; the model-space layouts (Adam's, the "
            "distributed optimizer's fully_reshardable) are mapped"
        )
    states = {}
    for name, weight in weights.tensors.items():
        saved_state = moments.get(name, {})
        if "exp_avg" not in saved_state or "exp_avg_sq" not in saved_state:
            raise UnmappedOptimizerState(f"{where} holds no Adam moments for {name}")
        main = saved_state.get("param", saved_state.get("fp32_param", weight.float()))
        states[name] = ParamState(main, saved_state["exp_avg"], saved_state["exp_avg_sq"], float(*steps))
    return optimizer_state_dict(states, settings)


def group_settings(groups: list[dict[str, Any]], where: str) -> dict[float, dict[str, Any]]:
    """The settings of each Megatron param group by its `wd_mult`, checking the groups are ones ours form: one
    per weight decay, without learning-rate multipliers."""
    mults = [group.get("wd_mult") for group in groups]
    if None in mults or len(set(mults)) != len(mults) or any(g.get("lr_mult", 1.0) != 1.0 for g in groups):
        raise UnmappedOptimizerState(
            f"{where}: param groups {[(g.get('wd_mult'), g.get('lr_mult')) for g in groups]} (wd_mult, lr_mult); "
            "only one group per weight decay, without learning-rate multipliers (--decoupled-lr), is mapped"
        )
    return {
        group["wd_mult"]: {key: group[key] for key in (*GROUP_SETTINGS, "step") if key in group}
        for group in groups
    }


def merge_settings(
    settings: dict[float, dict[str, Any]], more: dict[float, dict[str, Any]], where: str
) -> None:
    """Adds the group settings of another optimizer of the checkpoint (Megatron-Core's expert optimizer beside its
    dense one) to `settings`, refusing settings ours, one group per weight decay, cannot hold both of."""
    for mult, group in more.items():
        known = settings.setdefault(mult, group)
        differ = [key for key in GROUP_SETTINGS if key in known and key in group and known[key] != group[key]]
        if differ:
            raise UnmappedOptimizerState(
                f"{where}: its chained optimizers give the params of wd_mult {mult} different {differ}; one "
                "setting per weight decay is mapped"
            )


def optimizer_state_dict(
    states: dict[str, ParamState], settings: dict[float, dict[str, Any]]
) -> tuple[dict[str, torch.Tensor], dict]:
    """What `MegatronOptimizer.state_dict` returns for whole params: `<name>.<state>` tensors and the JSON part,
    its groups (decayed, then not) with the Megatron groups' settings."""
    tensors = {
        f"{name}.{'main_param' if key == 'main' else key}": getattr(state, key)
        for name, state in states.items()
        for key in STATE_TENSORS
    }
    meta = {
        "param_names": list(states),
        "param_groups": [
            {key: settings[mult][key] for key in GROUP_SETTINGS if key in settings[mult]}
            for mult in (1.0, 0.0)
            if mult in settings
        ],
        "scalars": {name: {"step": state.step} for name, state in states.items()},
        "tensor_states": {name: ["exp_avg", "exp_avg_sq"] for name in states},
        "grad_scaler": None,
    }
    return tensors, meta


def _rank_states(
    checkpoint: LegacyCheckpoint, tp_rank: int, pp_rank: int, ep_rank: int, family: ModelFamily
) -> tuple[list[tuple[str, ParamState]], list[list[dict[str, Any]]]]:
    """One rank's params (global names, in its order) with their state, and each of its optimizers' param groups.
    Megatron-Core keeps the expert params in an optimizer of their own when expert DP differs from DP (a
    ChainedOptimizer, saved as a list: the dense params' optimizer, then the experts'); an EP rank past the first
    gives only its experts' state (the dense params' is EP rank 0's)."""
    path = checkpoint.path(tp_rank, pp_rank, ep_rank=ep_rank)
    saved = checkpoint.files[(tp_rank, pp_rank, ep_rank)]
    if "optimizer" not in saved:
        raise UnmappedOptimizerState(f"{path} holds no optimizer state (saved with --no-save-optim)")
    if checkpoint.version < 3 or len(checkpoint.model_chunks(tp_rank, pp_rank, ep_rank)) > 1:
        raise UnmappedOptimizerState(
            f"{path}: the optimizer state of checkpoint_version {checkpoint.version} models and of interleaved "
            "pipelines (model0, model1, ...) is not mapped"
        )
    optimizers = _chained(saved["optimizer"], path)
    chained = [_adam(optimizer, path) for optimizer in optimizers]
    params = checkpoint.rank_tensors(tp_rank, pp_rank, family, ep_rank)
    # which optimizer holds the experts: by the mark Megatron-Core gives its groups (older files: the second)
    holds_experts = [
        len(chained) > 1 and any(g.get("is_expert_parallel", index == 1) for g in adam["param_groups"])
        for index, adam in enumerate(chained)
    ]
    optim_path = checkpoint.path(tp_rank, pp_rank, DISTRIBUTED_OPTIMIZER_FILE, ep_rank)
    buffers = None
    states: dict[int, ParamState] = {}
    for index, (optimizer, adam, experts) in enumerate(zip(optimizers, chained, holds_experts, strict=True)):
        part = [
            i for i, (name, _) in enumerate(params) if len(chained) == 1 or is_expert_name(name) == experts
        ]
        if ep_rank and not any(is_expert_name(params[i][0]) for i in part):
            continue  # the dense params' state is EP rank 0's
        subset = [params[i] for i in part]
        members = _group_members(subset, adam["param_groups"], path)
        if "state" in adam:
            found = _adam_states(adam, optimizer.get("fp32_from_fp16_params"), subset, members)
        else:
            buffers = buffers or _distributed_buffers(optim_path, len(chained))
            dp = _data_parallel_size(checkpoint.args, experts)
            offsets = buffer_offsets(subset, checkpoint.args, pp_rank, dp)
            found = _distributed_states(
                buffers[index], optim_path, subset, adam["param_groups"], members, offsets
            )
        states |= {part[i]: state for i, state in found.items()}
    selected = sorted(i for i in states if not ep_rank or is_expert_name(params[i][0]))
    return [(params[i][0], states[i]) for i in selected], [adam["param_groups"] for adam in chained]


def _chained(optimizer: Any, path: str) -> list[dict[str, Any]]:
    """The state dicts of a rank's optimizers: a ChainedOptimizer of several saves a list, one optimizer its own
    state dict; a dense one and an expert one are mapped."""
    chained = optimizer if isinstance(optimizer, list) else [optimizer]
    if not all(isinstance(o, dict) for o in chained):
        raise UnmappedOptimizerState(
            f"{path}: its optimizer state holds {[type(o).__name__ for o in chained]}, not optimizer state dicts"
        )
    if len(chained) > 2:
        raise UnmappedOptimizerState(
            f"{path} holds {len(chained)} chained optimizers; one, or Megatron-Core's dense and expert pair, is "
            "mapped (not --overlap-param-gather-with-optimizer-step's per-chunk optimizers)"
        )
    return chained


def _adam(optimizer: dict[str, Any], path: str) -> dict[str, Any]:
    """torch's Adam state dict inside one of Megatron's optimizer state dicts (bf16/fp16 wrap it)."""
    adam = optimizer.get("optimizer", optimizer)
    if not isinstance(adam, dict) or not isinstance(adam.get("param_groups"), list):
        raise UnmappedOptimizerState(f"{path}: an optimizer state without param_groups")
    return adam


def _adam_states(
    adam: dict[str, Any],
    fp32_mains: list[list[torch.Tensor]] | None,
    params: list[tuple[str, torch.Tensor]],
    members: list[list[int]],
) -> dict[int, ParamState]:
    """The states torch's Adam keeps by each param's index in its groups, by index into `params`."""
    states = {}
    for group_index, (group, indices) in enumerate(zip(adam["param_groups"], members, strict=True)):
        for position, (index, saved_index) in enumerate(zip(indices, group["params"], strict=True)):
            weight = params[index][1]
            if saved_index in adam["state"]:
                main = weight.float() if fp32_mains is None else fp32_mains[group_index][position]
                state = adam["state"][saved_index]
                states[index] = ParamState(main, state["exp_avg"], state["exp_avg_sq"], float(state["step"]))
    return states


def _group_members(
    params: list[tuple[str, torch.Tensor]], groups: list[dict[str, Any]], path: str
) -> list[list[int]]:
    """Per param group, the indices (into `params`) of its params, by the weight-decay rule the group records."""
    group_settings(groups, path)
    members = [
        [i for i, (name, tensor) in enumerate(params) if wd_mult(name, tensor) == g["wd_mult"]]
        for g in groups
    ]
    counts = [len(group["params"]) for group in groups if "params" in group]
    if counts and counts != [len(indices) for indices in members]:
        raise UnmappedOptimizerState(
            f"{path}: its param groups hold {counts} params but the model's weight-decay rule gives "
            f"{[len(indices) for indices in members]}"
        )
    return members


def _distributed_buffers(path: str, count: int) -> list[Any]:
    """What `distrib_optim.pt` holds per optimizer of the rank (a ChainedOptimizer saves a list; an entry is None
    where that optimizer's data-parallel rank 0 is another rank)."""
    if not os.path.exists(path):
        raise UnmappedOptimizerState(
            f"{path} is missing: the checkpoint was saved with the distributed optimizer, whose state is there"
        )
    saved = read_allowed_pickle(path, path)
    entries = saved if isinstance(saved, list) else [saved]
    if len(entries) != count:
        raise UnmappedOptimizerState(
            f"{path} holds the state of {len(entries)} optimizers but model_optim_rng.pt beside it {count}"
        )
    return entries


def _distributed_states(
    saved: Any,
    path: str,
    params: list[tuple[str, torch.Tensor]],
    groups: list[dict[str, Any]],
    members: list[list[int]],
    offsets: BufferOffsets,
) -> dict[int, ParamState]:
    """The states one optimizer's entry of `distrib_optim.pt` holds for its params, found by Megatron-Core's
    buffer layout (`offsets`)."""
    buffers = [key for key in saved if isinstance(key, int)] if isinstance(saved, dict) else []
    if (
        not isinstance(saved, dict)
        or not saved.get("buckets_coalesced")
        or buffers != [0]
        or len(saved[0]) != 1
    ):
        raise UnmappedOptimizerState(
            f"{path}: {len(buffers)} gradient buffers, buckets_coalesced="
            f"{saved.get('buckets_coalesced') if isinstance(saved, dict) else None}; one buffer of one dtype in "
            "Megatron-Core's coalesced layout is mapped"
        )
    (world,) = saved[0].values()
    if sum(numel for _, numel in offsets.buckets) != world["numel_unpadded"]:
        raise UnmappedOptimizerState(
            f"{path} holds {world['numel_unpadded']} elements but Megatron-Core's buffer layout of this rank's "
            f"params gives {sum(numel for _, numel in offsets.buckets)}: written by a Megatron version that lays "
            "its buffer out otherwise"
        )
    step_of = {
        index: float(group.get("step", 0))
        for group, ids in zip(groups, members, strict=True)
        for index in ids
    }
    states = {}
    for index, (name, weight) in enumerate(params):
        start = offsets.start(index)
        view = {
            key: world[key][start : start + weight.numel()].view(weight.shape)
            for key in ("param", "exp_avg", "exp_avg_sq")
        }
        if not torch.equal(view["param"].to(weight.dtype), weight):
            raise UnmappedOptimizerState(
                f"{path}: the main param found at element {start} for {name} is not its weight: written by a "
                "Megatron version that lays its buffer out otherwise"
            )
        states[index] = ParamState(view["param"], view["exp_avg"], view["exp_avg_sq"], step_of[index])
    return states


def _data_parallel_size(args: Any, experts: bool) -> int:
    """The size of the data-parallel group a gradient buffer is sharded over: DP (x CP) for the dense params,
    expert DP (world / (expert TP x EP x PP)) for the experts'."""
    dp = (getattr(args, "data_parallel_size", None) or 1) * (
        getattr(args, "context_parallel_size", None) or 1
    )
    if not experts:
        return dp
    tp = args.tensor_model_parallel_size
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    return max(dp * tp // (etp * expert_parallel_size(args)), 1)


@dataclass
class BufferOffsets:
    """Where each param of one rank lies in its gradient buffer and in the coalesced state tensors."""

    param_starts: dict[int, tuple[int, int]]  # param index -> (start in the buffer, bucket)
    buckets: list[tuple[int, int]]  # (start in the buffer, elements up to its last param's end)

    def start(self, index: int) -> int:
        """The param's first element in the coalesced tensors (buckets back to back, without end padding)."""
        start, bucket = self.param_starts[index]
        return sum(numel for _, numel in self.buckets[:bucket]) + start - self.buckets[bucket][0]


def buffer_offsets(
    params: list[tuple[str, torch.Tensor]], args: Any, pp_rank: int, buffer_dp: int
) -> BufferOffsets:
    """Megatron-Core's `_ParamAndGradBuffer` layout of one rank's params of one optimizer (its docstring,
    `__init__`), its buckets padded for the `buffer_dp` ranks that shard it."""
    pp = args.pipeline_model_parallel_size
    dp = getattr(args, "data_parallel_size", None) or 1
    bucket_size = None
    if getattr(args, "overlap_grad_reduce", False) and pp_rank == 0:
        bucket_size = getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * dp)
    divisor = math.lcm(
        buffer_dp, 128, *([2**16] if getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False) else [])
    )
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    shared = {WORD_EMBEDDING: pp_rank == 0, OUTPUT_WEIGHT: pp_rank == pp - 1}

    def pad(number: int, multiple: int) -> int:
        return math.ceil(number / multiple) * multiple

    param_starts: dict[int, tuple[int, int]] = {}
    buckets: list[tuple[int, int]] = []
    bucket_start = param_start = param_end = 0
    bucket_open = False

    def close(end: int) -> int:
        nonlocal bucket_start, bucket_open
        buckets.append((bucket_start, end - bucket_start))
        bucket_start, bucket_open = pad(end, divisor), False
        return bucket_start

    for index in reversed(range(len(params))):
        name, tensor = params[index]
        own_bucket = tied and pp > 1 and shared.get(name, False)
        param_start = pad(param_start, PARAM_ALIGNMENT)
        if own_bucket and bucket_open:
            param_start = close(param_start)
        param_end = param_start + tensor.numel()
        param_starts[index] = (param_start, len(buckets))
        bucket_open = True
        if (bucket_size is not None and param_end - bucket_start >= bucket_size) or own_bucket:
            param_start = close(param_end)
        else:
            param_start = param_end
    if bucket_open:
        close(param_end)
    return BufferOffsets(param_starts, buckets)
