"""How every parameter gets its first values, and models built on the meta device (sharded initialisation).

Megatron's two rules, chosen by --use-cpu-initialization:

- By default each rank materialises only its own shard: the training run builds the model under
  `torch.device("meta")` (no memory), then `materialize` allocates each parameter on the target device and runs
  the initializer the parameter recorded when it was created (`new_parameter`, `initialized`): a tensor-parallel
  shard draws from its TP rank's tracked RNG stream ("model-parallel-rng", seeded per TP rank:
  Megatron's `_initialize_affine_weight_gpu`), a replicated parameter from the default generator. No rank ever
  holds a full weight or a CPU copy, so a TP=N rank needs about 1/N of the weights' memory to start. The weights
  depend on the layout, as Megatron's do.
- With --use-cpu-initialization every part of the model draws its full weights on the CPU from its own stream
  (`random.initialization_stream`) and each rank keeps its slice (`layers.parallel_weight`): every layout starts
  from the same weights (docs/architecture.md, reproducibility).

A parameter a module of another family creates without an initializer is initialised by its module's
`reset_parameters()` (torch's own layers have one); anything else is refused by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_train.parallel.random import MODEL_PARALLEL_RNG, get_rng_tracker

Init = Callable[[torch.Tensor], Any]


@dataclass(frozen=True)
class Initializer:
    """`init` applied in place to a parameter's data; `tensor_parallel`: on the rank's tracked stream `stream`
    (the TP rank's, or the expert stream of an MoE expert's shard)."""

    init: Init
    tensor_parallel: bool = False
    stream: str = MODEL_PARALLEL_RNG

    @torch.no_grad()
    def __call__(self, tensor: torch.Tensor) -> None:
        with get_rng_tracker().fork(self.stream) if self.tensor_parallel else contextlib.nullcontext():
            self.init(tensor)


def initialized(
    param: nn.Parameter, init: Init, tensor_parallel: bool = False, stream: str = MODEL_PARALLEL_RNG
) -> nn.Parameter:
    """Record how `param` starts and start it so now, unless it lives on the meta device (then `materialize`
    does, on the device the model goes to). Calling it again replaces the rule (a tied copy that starts at 0)."""
    param.initializer = Initializer(init, tensor_parallel, stream)
    if not param.is_meta:
        param.initializer(param.data)
    return param


def new_parameter(
    shape: tuple[int, ...] | list[int],
    dtype: torch.dtype,
    init: Init,
    tensor_parallel: bool = False,
    stream: str = MODEL_PARALLEL_RNG,
) -> nn.Parameter:
    """A parameter of `shape` on the current default device (the meta device while a model is built for
    `materialize`), initialised by `init` (see `initialized`)."""
    return initialized(nn.Parameter(torch.empty(tuple(shape), dtype=dtype)), init, tensor_parallel, stream)


def new_buffer(shape: tuple[int, ...], dtype: torch.dtype, init: Init) -> torch.Tensor:
    """A buffer (model state that is not trained, as an MoE router's expert bias) made as `new_parameter` makes a
    parameter: on the meta device while a model is built for `materialize`, which allocates and starts it."""
    buffer = torch.empty(shape, dtype=dtype)
    buffer.initializer = Initializer(init)
    if not buffer.is_meta:
        buffer.initializer(buffer)
    return buffer


def materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """Allocate every meta-device parameter of `module` on `device` and initialise it (in module order): by the
    initializer it recorded, else by its module's `reset_parameters()` when none of that module's parameters
    recorded one. The parameters keep their attributes (TP sharding, sequence-parallel marks)."""
    replaced: dict[int, nn.Parameter] = {}
    to_reset: list[nn.Module] = []
    for name, submodule in module.named_modules():
        params = [(key, p) for key, p in submodule._parameters.items() if p is not None and p.is_meta]
        recorded = [hasattr(p, "initializer") for _, p in params]
        if any(recorded) and not all(recorded):
            missing = [key for (key, p), has in zip(params, recorded, strict=True) if not has]
            raise ValueError(f"{name or type(module).__name__}: parameters {missing} have no initializer")
        for key, param in params:
            if id(param) not in replaced:
                new = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device),
                    requires_grad=param.requires_grad,
                )
                new.__dict__.update(param.__dict__)
                if hasattr(new, "initializer"):
                    new.initializer(new.data)
                replaced[id(param)] = new
            submodule._parameters[key] = replaced[id(param)]
        if params and not any(recorded):
            if not hasattr(submodule, "reset_parameters"):
                raise ValueError(
                    f"{name or type(module).__name__} ({type(submodule).__name__}) holds parameters without an "
                    "initializer and has no reset_parameters(): create them with parallel.param_init.new_parameter, "
                    "or train with --use-cpu-initialization"
                )
            to_reset.append(submodule)
        for key, buffer in submodule._buffers.items():
            if buffer is not None and buffer.is_meta and hasattr(buffer, "initializer"):
                submodule._buffers[key] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
                buffer.initializer(submodule._buffers[key])
        meta_buffers = [key for key, b in submodule._buffers.items() if b is not None and b.is_meta]
        if meta_buffers:
            raise ValueError(
                f"{name}: buffers {meta_buffers} were built on the meta device; create them in forward or with "
                "new_buffer"
            )
    with torch.no_grad():
        for submodule in to_reset:
            submodule.reset_parameters()
    return module
