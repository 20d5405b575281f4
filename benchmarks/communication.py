"""Bytes each rank sends per training iteration under TP, SP, DP and the distributed optimizer, counted by
intercepting every collective, against the closed forms of the Megatron papers.

    .venv/bin/python -m benchmarks.communication [--layers 2 --hidden 64 --seq 32 --batch 2]

Counted: every all-reduce, all-gather and reduce-scatter of one training iteration (forward, backward, gradient
sync, optimizer step; after a warm-up iteration), turned into bytes sent per rank by a ring algorithm:
all-reduce 2(t-1)/t N, all-gather and reduce-scatter (t-1)/t N, for N bytes of the full tensor on t ranks.
Closed forms (Narayanan et al. 2021; Korthikanti et al. 2022, table 2):
- TP, per layer and micro-batch: 4 all-reduces of s*b*h activations (2 forward, 2 backward), plus the
  vocab-parallel embedding's forward and the output layer's backward (2 more), plus cross entropy's 3 of s*b.
- SP: each all-reduce becomes an all-gather plus a reduce-scatter of the same tensor: same bytes.
- DP: one all-reduce of the P gradients. Distributed optimizer: reduce-scatter of the gradients plus
  all-gather of the parameters: the same bytes as DP's all-reduce.
Pipeline parallel's point-to-point bytes are counted against their closed form in benchmarks/pipeline_bubble.py.
The last line is `ratio: <closed-form bytes / counted bytes>` over all configurations (1.0: exactly the theory).
"""

from __future__ import annotations

import argparse
import functools
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_train.distributed import ddp as ddp_module
from megatron_train.distributed.ddp import DDPConfig, DistributedDataParallel
from megatron_train.models import TransformerConfig
from megatron_train.models.gpt import GPTModel
from megatron_train.optimizer import get_megatron_optimizer
from megatron_train.parallel import mappings, state
from megatron_train.parallel.layers import allreduce_sequence_parallel_grads
from megatron_train.training.config import OptimizerConfig
from tests.helpers.distributed import run_distributed

VOCAB = 256
LAYOUTS = {  # name: (world size, tensor parallel, sequence parallel, distributed optimizer)
    "TP2": (2, 2, False, False),
    "TP2+SP": (2, 2, True, False),
    "TP4": (4, 4, False, False),
    "DP2": (2, 1, False, False),
    "DP2+distributed optimizer": (2, 1, False, True),
    "DP4+distributed optimizer": (4, 1, False, True),
}


class ByteCounter:
    """Wraps collectives; adds the ring algorithm's bytes sent per rank, by kind of traffic."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = defaultdict(float)
        self.active = False

    def wrap(self, fn: Callable, kind: str, factor: Callable[[int], float], full_tensor_arg: int) -> Callable:
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.active:
                group = kwargs.get("group")
                ranks = dist.get_world_size(group)
                tensor = args[full_tensor_arg]
                if ranks > 1:
                    self.sent[kind] += factor(ranks) * tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted

    def install(self) -> None:
        all_reduce = self.wrap(dist.all_reduce, "all-reduce", lambda t: 2 * (t - 1) / t, 0)
        gather = self.wrap(mappings._all_gather_single, "all-gather", lambda t: (t - 1) / t, 0)
        scatter = self.wrap(mappings._reduce_scatter_single, "reduce-scatter", lambda t: (t - 1) / t, 1)
        dist.all_reduce = all_reduce
        mappings._all_gather_single = gather
        mappings._reduce_scatter_single = scatter
        ddp_module._all_gather = self.wrap(ddp_module._all_gather, "all-gather", lambda t: (t - 1) / t, 0)
        ddp_module._reduce_scatter = self.wrap(
            ddp_module._reduce_scatter, "reduce-scatter", lambda t: (t - 1) / t, 1
        )


def _worker(rank: int, world_size: int, layout: str, args: argparse.Namespace) -> dict:
    _, tp, sp, distributed_optimizer = LAYOUTS[layout]
    counter = ByteCounter()
    counter.install()
    state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, seq_length=args.seq,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    module = GPTModel(config, VOCAB, sequence_parallel=sp)
    model = DistributedDataParallel(
        module, DDPConfig(use_distributed_optimizer=distributed_optimizer), state.get_data_parallel_group()
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, clip_grad=1.0), model, use_distributed_optimizer=distributed_optimizer
    )
    tokens = torch.randint(
        0, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank // tp)
    )

    def step() -> None:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(tokens, labels=torch.roll(tokens, -1, dims=1)).mean().backward()
        model.finish_grad_sync()
        if sp:
            allreduce_sequence_parallel_grads(module)
        optimizer.step()

    step()
    counter.active = True
    step()
    counter.active = False
    params = sum(p.numel() for p in module.parameters())
    state.destroy_model_parallel()
    return {"sent": dict(counter.sent), "local_params": params}


def closed_form(layout: str, args: argparse.Namespace, local_params: int) -> float:
    """Bytes sent per rank per iteration by the papers' formulas (fp32 activations and gradients)."""
    world, tp, _, _ = LAYOUTS[layout]
    sbh = args.seq * args.batch * args.hidden * 4
    if tp > 1:
        ring = 2 * (tp - 1) / tp
        return ring * ((4 * args.layers + 2) * sbh + 3 * args.seq * args.batch * 4)
    dp = world
    return 2 * (dp - 1) / dp * local_params * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    print(f"GPT {args.layers} layers x {args.hidden} wide, seq {args.seq}, micro-batch {args.batch}, fp32")
    print(f"{'layout':<28}{'counted (bytes/rank)':>22}{'closed form':>14}{'counted/theory':>16}   by kind")
    total_counted = total_theory = 0.0
    for layout, (world, *_rest) in LAYOUTS.items():
        results = run_distributed(_worker, world, layout, args, timeout=600)
        sent = results[0]["sent"]
        counted = sum(sent.values())
        theory = closed_form(layout, args, results[0]["local_params"])
        total_counted += counted
        total_theory += theory
        kinds = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(sent.items()))
        print(f"{layout:<28}{counted:>22,.0f}{theory:>14,.0f}{counted / theory:>16.3f}   {kinds}")
    print(
        "(extra bytes beyond the formulas: gradient-norm and loss-scale all-reduces of a few scalars; under SP the"
    )
    print(
        " layer-norm gradients' all-reduce across TP; in the embedding under SP, an all-reduce then a scatter)"
    )
    print(f"ratio: {total_theory / total_counted:.3f}")


if __name__ == "__main__":
    main()
