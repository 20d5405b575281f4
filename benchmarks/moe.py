"""MoE layer throughput and traffic: our MoELayer against transformers' MixtralSparseMoeBlock with the same weights,
our grouped-GEMM experts against our loop over experts and a plain torch.mm of the same FLOPs, and the alltoall
dispatcher's all-to-all bytes against its closed form.

    .venv/bin/python -m benchmarks.moe [--hidden 256 --ffn 512 --experts 8 --topk 2 --tokens 1024 --repeats 3]

Throughput: forward + backward of one layer (router, dispatch, experts, combine; no auxiliary loss, as the peer
computes none) on `--tokens` tokens, fp32, in tokens/s, at the same thread count. The peer runs in each of
transformers' expert implementations named by `--peer` (`eager`: a loop over the hit experts, `grouped_mm`:
torch's grouped GEMM; `batched_mm`, which gathers a weight matrix per (token, expert) pair, is an order of
magnitude slower on CPU and left out unless named) and is compared in its fastest; its outputs are checked equal to
ours before timing. Each repeat runs every variant back to back, so a shared machine's load hits them alike; the
ratios are medians over repeats.

Traffic: 2 gloo ranks, EP=2, alltoall dispatcher, one forward + backward. A rank's all_to_all payload is its
n_out (token, expert) pairs routed to the other rank's experts, sent out in the dispatch and their gradients back
in the backward of the combine, and the n_in pairs the other rank routed here, returned in the combine and their
gradients sent in the dispatch's backward: 2 (n_out + n_in) rows of `--hidden` fp32 values. For uniform routing
n_out = n_in = tokens x top k x (EP - 1) / EP. The counted bytes must equal the closed form exactly.

Ours runs with --moe-grouped-gemm (the kernel it picks is named: on CPU a padded bmm for balanced routing), with
grouped_mm forced, and as a loop over experts. The machine's ceiling is a plain `torch.mm` [rows, h] x [h, 3 ffn] run three times, rows chosen
for the layer's matmul FLOPs (`step_flops`: router, fc1 and fc2 forward, twice that backward); every variant's
GFLOP/s counts those FLOPs.

The last line is `ratio: <ours / peer's fastest>` (tokens/s).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import transformers

from megatron_train.models import TransformerConfig
from megatron_train.models.moe import comm
from megatron_train.models.moe.layer import MoELayer
from megatron_train.parallel import state
from tests.helpers.distributed import run_distributed

PEER_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="each expert's hidden size")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--peer", nargs="+", choices=PEER_IMPLEMENTATIONS, default=["eager", "grouped_mm"],
        help="transformers' expert implementations to time",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="default: all cores")
    return parser.parse_args()


def moe_config(args: argparse.Namespace, grouped: bool) -> TransformerConfig:
    """A Mixtral-style MoE layer: SwiGLU experts, no biases, softmax over the top k router logits."""
    return TransformerConfig.llama(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=4, seq_length=args.tokens,
        num_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn,
        moe_grouped_gemm=grouped, moe_token_dispatcher_type="alltoall",
    )  # fmt: skip


def mixtral_block(layer: MoELayer, args: argparse.Namespace) -> torch.nn.Module:
    """transformers' MixtralSparseMoeBlock holding `layer`'s weights (its [out, in] expert layout)."""
    config = transformers.MixtralConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_local_experts=args.experts,
        num_experts_per_tok=args.topk, router_jitter_noise=0.0,
    )  # fmt: skip
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(layer.experts.weight1.transpose(1, 2))
        block.experts.down_proj.copy_(layer.experts.weight2.transpose(1, 2))
    return block


def step_time(run: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    start, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - start, time.process_time() - cpu


def step_flops(args: argparse.Namespace) -> int:
    """Matmul FLOPs of one forward + backward of the layer: the router on every token, fc1 (SwiGLU's gate and up:
    2 ffn wide) and fc2 on each of the tokens x top k routed rows; the backward twice the forward."""
    rows = args.tokens * args.topk
    forward = 2 * args.tokens * args.hidden * args.experts + 2 * rows * args.hidden * 3 * args.ffn
    return 3 * forward


def throughput(args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    layer = MoELayer(moe_config(args, grouped=True), 0, sequence_parallel=False).train()
    block = mixtral_block(layer, args).train()
    x = torch.randn(args.tokens, 1, args.hidden)
    grad = torch.randn_like(x)
    with torch.no_grad():
        ours = layer(x)
        for implementation in args.peer:
            block.experts.config._experts_implementation = implementation
            torch.testing.assert_close(block(x.transpose(0, 1)).transpose(0, 1), ours, rtol=1e-4, atol=1e-5)
        _, routing_map = layer.router(x)
        counts = routing_map.sum(dim=0).tolist()
        kernel = layer.experts.kernel(torch.empty(sum(counts), args.hidden), counts)

    def peer(implementation: str) -> Callable[[], None]:
        def run() -> None:
            block.experts.config._experts_implementation = implementation
            tokens = x.detach().requires_grad_(True)
            block(tokens.transpose(0, 1)).transpose(0, 1).backward(grad)

        return run

    def ours_with(grouped: bool, padded_rows_limit: float) -> Callable[[], None]:
        def run() -> None:
            layer.experts.grouped_gemm, layer.experts.padded_rows_limit = grouped, padded_rows_limit
            layer(x.detach().requires_grad_(True)).backward(grad)

        return run

    # the machine's ceiling: a plain torch.mm [rows, h] x [h, 3 ffn] three times, rows chosen for the layer's FLOPs
    rows = round(step_flops(args) / (3 * 2 * args.hidden * 3 * args.ffn))
    left, right = torch.randn(rows, args.hidden), torch.randn(args.hidden, 3 * args.ffn)

    def ceiling() -> None:
        for _ in range(3):
            torch.mm(left, right)

    ours_name = f"ours --moe-grouped-gemm ({kernel})"
    variants = {
        ours_name: ours_with(True, layer.experts.padded_rows_limit),
        "ours grouped_mm (never padded)": ours_with(True, 0.0),
        "ours loop over experts": ours_with(False, 0.0),
    }
    variants |= {f"transformers {name}": peer(name) for name in args.peer}
    variants["torch.mm of the same FLOPs"] = ceiling
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu_times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, run in variants.items():
            seconds, cpu_seconds = step_time(run)
            if repeat:
                times[name].append(seconds)
                cpu_times[name].append(cpu_seconds)
    flops = {name: step_flops(args) for name in times} | {
        "torch.mm of the same FLOPs": 3 * left.shape[0] * right.numel() * 2
    }
    for name, seconds in times.items():
        wall, cpu = statistics.median(seconds), statistics.median(cpu_times[name])
        print(f"{name:36s} {args.tokens / wall:9.1f} tokens/s (fwd+bwd), {args.tokens / cpu:9.1f} tokens per CPU "
              f"second, {flops[name] / wall / 1e9:6.1f} GFLOP/s")  # fmt: skip
    fastest = min(
        (n for n in times if n.startswith("transformers")), key=lambda n: statistics.median(times[n])
    )

    def paired(slow: str, fast: str, measured: dict[str, list[float]]) -> float:
        """Median over repeats of time(slow) / time(fast): how many times faster `fast` ran."""
        return statistics.median(a / b for a, b in zip(measured[slow], measured[fast], strict=True))

    for slow, label in (
        ("ours loop over experts", "ours loop over experts"),
        ("ours grouped_mm (never padded)", "ours grouped_mm (never padded)"),
        ("torch.mm of the same FLOPs", "the torch.mm ceiling"),
        (fastest, f"{fastest} (the peer's fastest on this machine)"),
    ):
        print(
            f"{ours_name} / {label}: {paired(slow, ours_name, times):.3f} "
            f"(CPU time {paired(slow, ours_name, cpu_times):.3f})"
        )
    return paired(fastest, ours_name, times)


def _traffic(rank: int, world_size: int, args: argparse.Namespace) -> tuple[int, int]:
    """(counted all_to_all bytes this rank sent, the closed form from its routing)."""
    torch.set_num_threads(1)
    state.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        torch.manual_seed(0)
        layer = MoELayer(moe_config(args, grouped=True), 0, sequence_parallel=False).train()
        torch.manual_seed(1 + rank)
        x = torch.randn(args.tokens, 1, args.hidden, requires_grad=True)
        _, routing_map = layer.router(x)
        mine = (
            layer.token_dispatcher.first_expert,
            layer.token_dispatcher.first_expert + layer.experts.weight1.shape[0],
        )
        remote = torch.ones(args.experts, dtype=torch.bool)
        remote[mine[0] : mine[1]] = False
        n_out = int(routing_map[:, remote].sum())
        n_in = torch.tensor(n_out)
        dist.all_reduce(n_in)  # 2 ranks: the other rank's pairs routed here = total - mine
        comm.ALL_TO_ALL_BYTES[0] = 0
        layer(x).backward(torch.randn_like(x))
        return comm.ALL_TO_ALL_BYTES[0], 2 * (n_out + int(n_in) - n_out) * args.hidden * 4
    finally:
        state.destroy_model_parallel()


def traffic(args: argparse.Namespace) -> None:
    results = run_distributed(_traffic, 2, args)
    for rank, (counted, closed) in enumerate(results):
        print(f"EP=2 alltoall, rank {rank}: all_to_all {counted} bytes sent, closed form {closed}")
        assert counted == closed, (counted, closed)
    uniform = 2 * 2 * args.tokens * args.topk / 2 * args.hidden * 4
    print(f"closed form under uniform routing: {uniform:.0f} bytes a rank")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads: {args.threads}; {args.tokens} tokens, hidden {args.hidden}, {args.experts} experts of "
          f"{args.ffn}, top {args.topk}")  # fmt: skip
    traffic(args)
    ratio = throughput(args)
    print(f"ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
