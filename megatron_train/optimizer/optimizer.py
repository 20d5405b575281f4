"""Megatron's optimizer wrapper: fp32 main params for bf16/fp16 models, loss scaling, clipping, AdamW.

The model's params may be bf16/fp16; the optimizer keeps an fp32 copy of each (the "main" param) and fp32
grads, steps on those, and copies the result back. With fp32 models the main param is the model param.
Grads are read from `param.main_grad` (the local DDP's contiguous buffer) when present, else `param.grad`.
`DistributedOptimizer` (distrib_optimizer.py) subclasses it and overrides the hooks that touch main params.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_train.device import get_device
from megatron_train.distributed.ddp import is_expert_parameter
from megatron_train.optimizer.clip_grads import (
    ShardingGroups,
    all_reduce_grad_stat,
    clip_grads_by_total_norm,
    count_zeros_fp32,
    get_grad_norm_fp32,
)
from megatron_train.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_train.training.config import OptimizerConfig


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: biases and 1-D params (norm weights) are not decayed (the MoE experts' stacked biases,
    `experts.bias1` / `bias2`, are biases too)."""
    return name.rsplit(".", 1)[-1].startswith("bias") or param.dim() == 1


# Megatron-Core marks these `is_embedding_or_output_parameter`: the word embedding and the untied output layer.
EMBEDDING_OR_OUTPUT_SUFFIXES = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_embedding_or_output(name: str) -> bool:
    return name.endswith(EMBEDDING_OR_OUTPUT_SUFFIXES)


def get_param_groups(
    named_params: list[tuple[str, torch.nn.Parameter]],
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
) -> list[dict]:
    """Decayed and not (`wd_mult` 0; the scheduler multiplies each group's weight decay by it).

    With `decoupled_lr` (Megatron's --decoupled-lr) the word embedding and output layer get groups of their own
    whose schedule peaks at `max_lr` = decoupled_lr and decays to `min_lr` = decoupled_min_lr (when given).
    """
    decoupled: dict[str, float] = {}
    if decoupled_lr is not None:
        decoupled["max_lr"] = decoupled_lr
        if decoupled_min_lr is not None:
            decoupled["min_lr"] = decoupled_min_lr

    def group_of(name: str, param: torch.nn.Parameter) -> tuple[bool, bool]:
        return bool(decoupled) and is_embedding_or_output(name), not no_weight_decay(name, param)

    groups = []
    for own_lr in (False, True):
        for decay in (True, False):
            params = [p for n, p in named_params if group_of(n, p) == (own_lr, decay)]
            overrides = decoupled if own_lr else {}
            groups.append({"params": params, "wd_mult": 1.0 if decay else 0.0, "lr_mult": 1.0, **overrides})
    return [g for g in groups if g["params"]]


class MegatronOptimizer:
    """One optimizer step as Megatron takes it: grads -> fp32, unscale and overflow check, clip, step, copy back.

    `step()` returns `(update_successful, grad_norm, num_zeros_in_grad)` (the last None unless
    --log-num-zeros-in-grad); an fp16 step whose grads overflowed is skipped (no update, grad_norm None) and the
    loss scaler backs off. `main_params[i]` is the fp32 tensor the
    optimizer steps for `model_params[i]` (None where a subclass holds no part of that param).
    """

    shards_state_over_data_parallel = (
        False  # each DP rank holds all of it (the distributed optimizer: a part)
    )
    # The data-parallel groups over which each rank holds a different part of the grads (the distributed
    # optimizer's shards): the grad statistics are then reduced over them too.
    grads_sharded_over: ShardingGroups = None

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        config: OptimizerConfig,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        named_params = [(n, p) for n, p in named_params if p.requires_grad]
        self.config = config
        self.mixed_precision = params_dtype != torch.float32
        self.names = [n for n, _ in named_params]
        self.model_params = [p for _, p in named_params]
        self.main_params = self._build_main_params()
        for main, model in zip(self.main_params, self.model_params, strict=True):
            if main is not None and main is not model:
                copy_parallel_attributes(model, main)
        main_of = {id(model): main for model, main in zip(self.model_params, self.main_params, strict=True)}
        groups = get_param_groups(named_params, config.decoupled_lr, config.decoupled_min_lr)
        for group in groups:  # a subclass's rank may hold no part of a group: kept empty
            group["params"] = [main_of[id(p)] for p in group["params"] if main_of[id(p)] is not None]
        self.optimizer = _build_torch_optimizer(groups, config)
        self.grad_scaler = _build_grad_scaler(config, params_dtype)

    def _build_main_params(self) -> list[torch.Tensor | None]:
        if self.mixed_precision:
            return [p.detach().float().clone() for p in self.model_params]
        return list(self.model_params)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def zero_grad(self) -> None:
        for param in self.model_params:
            param.grad = None
        for param in self.main_params:
            if param is not None:
                param.grad = None

    def _main_grads(self) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
        """Point each main param's .grad at the fp32 grad of its model param; return those that have one."""
        params, grads = [], []
        for model, main in zip(self.model_params, self.main_params, strict=True):
            grad = getattr(model, "main_grad", None)
            if grad is None:
                grad = model.grad
            if grad is None:
                main.grad = None
                continue
            main.grad = grad.float()
            params.append(main)
            grads.append(main.grad)
        return params, grads

    def _unscale_and_check_for_inf(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
        """Unscale the grads; whether any grad of any rank is not finite (dense and expert parts reduced over
        their groups)."""
        flags = []
        for expert in (False, True):
            part = [g for p, g in zip(params, grads, strict=True) if is_expert_parameter(p) == expert]
            found_inf = torch.zeros((), dtype=torch.float32, device=get_device())
            if part:
                torch._foreach_mul_(part, self.grad_scaler.inv_scale)
                finite = torch.stack([torch.isfinite(g).all() for g in part]).all()
                found_inf = (~finite).float().to(found_inf.device)
            flags.append(found_inf)
        found = all_reduce_grad_stat(*flags, dist.ReduceOp.MAX, self.grads_sharded_over)
        return bool(found.item() > 0)

    def _copy_main_params_to_model_params(self) -> None:
        if self.mixed_precision:
            for model, main in zip(self.model_params, self.main_params, strict=True):
                model.data.copy_(main.data)

    def _local_part(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """The part of a full (checkpointed) tensor of `model_params[index]` that `main_params[index]` holds."""
        return full

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, float | None]:
        params, grads = self._main_grads()
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check_for_inf(params, grads)
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        grad_norm = get_grad_norm_fp32(params, grads, self.grads_sharded_over)
        if self.config.clip_grad > 0.0:
            clip_grads_by_total_norm(grads, self.config.clip_grad, grad_norm)
        num_zeros = (
            count_zeros_fp32(params, grads, self.grads_sharded_over)
            if self.config.log_num_zeros_in_grad
            else None
        )
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True, grad_norm, num_zeros

    def reload_model_params(self) -> None:
        """Re-copy the model's weights into the fp32 main params (after loading weights without optimizer)."""
        if self.mixed_precision:
            for model, main in zip(self.model_params, self.main_params, strict=True):
                main.data.copy_(model.data)

    def _full_param_states(self) -> list[tuple[str, torch.Tensor, dict]]:
        """(name, fp32 main param, optimizer state) per param, each tensor the param's full shape."""
        return [
            (name, main.detach(), self.optimizer.state.get(main, {}))
            for name, main in zip(self.names, self.main_params, strict=True)
        ]

    # -- this rank's part of the state, for sharded checkpoints (checkpointing.dist_checkpoint) ------------------

    def local_param_ranges(self) -> list[tuple[int, int, int]]:
        """(index, start, end) of each param this rank holds optimizer state for: elements [start, end) of the
        flattened (TP-local) param; all of it here, the rank's part under the distributed optimizer."""
        return [(i, 0, p.numel()) for i, p in enumerate(self.model_params) if self.main_params[i] is not None]

    def local_state(self, index: int) -> dict[str, torch.Tensor]:
        """1-D views of what this rank holds of param `index`'s state, over its range: `fp32_param` (the main
        param, mixed precision only; Megatron-Core's name) and each tensor state (exp_avg, exp_avg_sq, ...)."""
        main = self.main_params[index]
        views = {"fp32_param": main.detach().reshape(-1)} if self.mixed_precision else {}
        for key, value in self.optimizer.state.get(main, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                views[key] = value.reshape(-1)
        return views

    def local_scalars(self, index: int) -> dict[str, float]:
        """Param `index`'s scalar state (Adam's step)."""
        state = self.optimizer.state.get(self.main_params[index], {})
        return {
            key: float(value)
            for key, value in state.items()
            if value is not None and not (isinstance(value, torch.Tensor) and value.dim() > 0)
        }

    @torch.no_grad()
    def set_local_state(
        self, index: int, tensors: dict[str, torch.Tensor], scalars: dict[str, float]
    ) -> None:
        """Inverse of `local_state` / `local_scalars` for param `index` (call `finish_loading` after the last)."""
        main = self.main_params[index]
        if self.mixed_precision:
            main.copy_(tensors["fp32_param"].view_as(main))
        state = {key: torch.tensor(value, dtype=torch.float32) for key, value in scalars.items()}
        state.update({k: v.view_as(main).to(main.device) for k, v in tensors.items() if k != "fp32_param"})
        if state:
            self.optimizer.state[main] = state

    @torch.no_grad()
    def finish_loading(self, meta: dict) -> None:
        """After the per-param state: the model params from the main params, the param groups' settings and the
        loss scaler from `meta` (what `state_dict()` returns beside the tensors)."""
        self._copy_main_params_to_model_params()
        for group, saved in zip(self.optimizer.param_groups, meta["param_groups"], strict=True):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
        if self.grad_scaler is not None and meta["grad_scaler"] is not None:
            self.grad_scaler.load_state_dict(meta["grad_scaler"])

    def state_meta(self) -> dict:
        """The JSON part of the state that is not per param: the param groups' settings and the loss scaler."""
        return {
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ],
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
        }

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors keyed `<param name>.<state>`, JSON-able rest): fp32 main params, Adam moments, scalars."""
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, dict[str, float]] = {}
        tensor_states: dict[str, list[str]] = {}
        for name, main, param_state in self._full_param_states():
            if self.mixed_precision:
                tensors[f"{name}.main_param"] = main
            for key, value in param_state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tensors[f"{name}.{key}"] = value
                    tensor_states.setdefault(name, []).append(key)
                elif value is not None:
                    scalars.setdefault(name, {})[key] = float(value)
        meta = {
            "param_names": self.names,
            **self.state_meta(),
            "scalars": scalars,
            "tensor_states": tensor_states,
        }
        return tensors, meta

    def load_state_dict(
        self, tensors: dict[str, torch.Tensor], meta: dict, source: str = "checkpoint"
    ) -> None:
        """Inverse of `state_dict`; `source` names the files in error messages."""
        if meta["param_names"] != self.names:
            missing = sorted(set(self.names) - set(meta["param_names"]))
            extra = sorted(set(meta["param_names"]) - set(self.names))
            raise ValueError(
                f"{source}: optimizer state does not match the model's parameters (missing {missing[:5]}, "
                f"unexpected {extra[:5]}); load with --no-load-optim to start the optimizer afresh"
            )
        with torch.no_grad():
            for index, (name, model, main) in enumerate(
                zip(self.names, self.model_params, self.main_params, strict=True)
            ):
                if main is None:
                    continue
                if self.mixed_precision:
                    main.copy_(self._local_part(index, _take(tensors, f"{name}.main_param", model, source)))
                state = {
                    key: torch.tensor(v, dtype=torch.float32)
                    for key, v in meta["scalars"].get(name, {}).items()
                }
                for key in meta["tensor_states"].get(name, []):
                    state[key] = self._local_part(
                        index, _take(tensors, f"{name}.{key}", model, source)
                    ).clone()
                if state:
                    self.optimizer.state[main] = state
        self.finish_loading(meta)


def copy_parallel_attributes(source: torch.Tensor, target: torch.Tensor) -> None:
    """Carry TP sharding and tied-weight marks over to an fp32 main param (the grad-norm rules read them)."""
    for attr in (
        "tensor_model_parallel",
        "partition_dim",
        "partition_stride",
        "partition_sizes",
        "shared",
        "allreduce",
    ):
        if hasattr(source, attr):
            setattr(target, attr, getattr(source, attr))


def _take(tensors: dict[str, torch.Tensor], key: str, like: torch.Tensor, source: str) -> torch.Tensor:
    if key not in tensors:
        raise ValueError(
            f"{source}: optimizer tensor {key!r} is missing; load with --no-load-optim to skip it"
        )
    value = tensors[key]
    if value.shape != like.shape:
        raise ValueError(
            f"{source}: optimizer tensor {key!r} has shape {tuple(value.shape)} but the parameter has "
            f"{tuple(like.shape)}; the checkpoint was saved with a different model or parallel layout"
        )
    return value.to(device=like.device, dtype=torch.float32)


def _build_torch_optimizer(groups: list[dict], config: OptimizerConfig) -> torch.optim.Optimizer:
    lr = config.lr if config.lr is not None else 0.0
    if config.optimizer == "adam":
        return torch.optim.AdamW(
            groups,
            lr=lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            foreach=True,
        )
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, weight_decay=config.weight_decay, momentum=config.sgd_momentum)
    raise ValueError(f"--optimizer {config.optimizer!r}: choose adam or sgd")


def _build_grad_scaler(config: OptimizerConfig, params_dtype: torch.dtype) -> ConstantGradScaler | None:
    """fp16 gets a loss scaler (static with --loss-scale, else dynamic); bf16 and fp32 need none."""
    if params_dtype != torch.float16:
        return None
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    return DynamicGradScaler(
        initial_scale=config.initial_loss_scale,
        min_scale=config.min_loss_scale,
        growth_interval=config.loss_scale_window,
        hysteresis=config.hysteresis,
    )
