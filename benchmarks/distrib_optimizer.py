"""Distributed-optimizer training step: ours (local DDP reduce-scatter + sharded AdamW + param all-gather)
against torch's DDP + ZeroRedundancyOptimizer(AdamW), the same GPT, batch and clipping, DP=2 on gloo.

Each rank times fwd + bwd + grad reduction + optimizer step; the two setups alternate within each repeat so
machine load hits both alike. Prints the median step time of each and per-rank optimizer-state bytes.
The last line is `ratio: <peer_time / our_time>` (higher is better: ours faster).

    .venv/bin/python -m benchmarks.distrib_optimizer [--layers 4 --hidden 256 --seq 128 --batch 4 --repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from megatron_train.distributed import DDPConfig, DistributedDataParallel
from megatron_train.models import GPTModel, TransformerConfig
from megatron_train.optimizer import DistributedOptimizer
from megatron_train.training.config import OptimizerConfig
from tests.helpers.distributed import run_distributed

VOCAB = 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return parser.parse_args()


def _gpt(args: argparse.Namespace) -> GPTModel:
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 64,
        seq_length=args.seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(config, VOCAB)


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens, labels=torch.roll(tokens, -1, dims=1)).mean()


def _ours(args: argparse.Namespace):
    model = DistributedDataParallel(
        _gpt(args), DDPConfig(overlap_grad_reduce=True, use_distributed_optimizer=True)
    )
    optimizer = DistributedOptimizer(model, OptimizerConfig(lr=1e-4, clip_grad=1.0))

    def step(tokens: torch.Tensor) -> None:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        _loss(model, tokens).backward()
        model.finish_grad_sync()
        optimizer.step()

    return step, lambda: sum(
        v.nbytes for s in optimizer.optimizer.state.values() for v in s.values() if v.dim() > 0
    )


def _peer(args: argparse.Namespace):
    module = _gpt(args)
    model = torch.nn.parallel.DistributedDataParallel(module, broadcast_buffers=False)
    optimizer = ZeroRedundancyOptimizer(
        module.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4, weight_decay=0.01, foreach=True
    )

    def step(tokens: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        _loss(model, tokens).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)  # grads are whole after DDP's all-reduce
        optimizer.step()

    return step, lambda: sum(
        v.nbytes for s in optimizer.optim.state.values() for v in s.values() if v.dim() > 0
    )


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq), generator=generator)
    setups = {"ours": _ours(args), "peer": _peer(args)}
    for step, _ in setups.values():  # warm-up: allocates optimizer states
        step(tokens)
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(args.repeats):
        for name, (step, _) in setups.items():
            dist.barrier()
            start = time.perf_counter()
            step(tokens)
            times[name].append(time.perf_counter() - start)
    return {
        "median": {name: statistics.median(t) for name, t in times.items()},
        "state_bytes": {name: state_bytes() for name, (_, state_bytes) in setups.items()},
    }


def main() -> None:
    args = parse_args()
    results = run_distributed(_worker, 2, args, timeout=1800)
    params = sum(p.numel() for p in _gpt(args).parameters())
    print(
        f"GPT {args.layers}x{args.hidden}, {params / 1e6:.2f}M params, seq {args.seq}, batch {args.batch}/rank, DP=2"
    )
    for name in ("ours", "peer"):
        step = max(r["median"][name] for r in results)
        states = [r["state_bytes"][name] / params for r in results]
        print(
            f"{name}: step {step * 1000:.1f} ms (median of {args.repeats}, slowest rank); "
            f"optimizer states per rank {', '.join(f'{b:.2f}' for b in states)} bytes/param"
        )
    ours, peer = (max(r["median"][n] for r in results) for n in ("ours", "peer"))
    print(f"ratio: {peer / ours:.3f}")


if __name__ == "__main__":
    main()
