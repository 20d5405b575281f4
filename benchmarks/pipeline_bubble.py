"""Pipeline bubble and p2p traffic of the 1F1B and interleaved schedules against their closed forms.

Every layer does the same fixed matmul, so stages are balanced and the only idle time is the schedule's:
1F1B idles (p - 1) / m of its compute time, interleaving with v chunks (p - 1) / (v * m). Idle time is
measured as the time each rank spends inside p2p calls (posting them and waiting for them: blocked on a
neighbour, plus the transfer itself: about a millisecond per MB over gloo on localhost, which is why
measured / theory grows with m as the theoretical bubble shrinks), compute as the rest of the step. 1F1B runs
twice in one process group, each exchange waited for (`blocking`, --no-overlap-p2p-communication) and its
steady-state exchanges posted without waiting (`overlapped`, the default), so the idle time the overlap removes
shows in the same run. Bytes sent per rank per iteration are
checked against m * (s * b * h * bytes) per boundary crossed, per direction.

Run from the repository root: .venv/bin/python -m benchmarks.pipeline_bubble [--pipeline-sizes 2 4]
[--microbatches 4 8 16]
Ends with `ratio: <measured / theoretical bubble, 1F1B, largest m>` for the largest p that gets a core per
stage on this machine. With fewer cores than stages the ranks share cores and the bubble is overstated.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from megatron_train.parallel import state
from megatron_train.parallel.p2p import P2PCommunicator, PendingExchange, p2p_counters
from megatron_train.parallel.schedules import get_forward_backward_func
from tests.helpers.distributed import run_distributed

VIRTUAL_SIZE = 2


class BusyStage(nn.Module):
    """`num_layers` identical Linear+tanh layers on [s, b, h] activations: equal work per layer."""

    def __init__(self, num_layers: int, hidden: int, pre_process: bool) -> None:
        super().__init__()
        self.pre_process = pre_process
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        self.input_tensor = input_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x if self.pre_process else self.input_tensor
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        return hidden


def forward_step(data_iterator: Iterator, model: nn.Module):
    output = model(next(data_iterator))
    return output, lambda out: (out.pow(2).mean(), {})


class ExchangeTimer:
    """Wraps P2PCommunicator.post and PendingExchange.wait in this process (a blocking exchange is one of each)
    to add up the time spent in them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for owner, name in ((P2PCommunicator, "post"), (PendingExchange, "wait")):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def measure(
    rank: int,
    world_size: int,
    num_layers: int,
    microbatches: list[int],
    seq: int,
    batch: int,
    hidden: int,
    repeats: int,
) -> list[dict]:
    """On each rank: one step per (schedule, m) and repeat; step time, time blocked in p2p, bytes sent."""
    timer = ExchangeTimer()
    rows = []
    for virtual_size, overlap in ((None, False), (None, True), (VIRTUAL_SIZE, False)):
        state.initialize_model_parallel(
            pipeline_model_parallel_size=world_size, virtual_pipeline_model_parallel_size=virtual_size
        )
        num_chunks = virtual_size or 1
        torch.manual_seed(rank)
        chunks = [
            BusyStage(num_layers // (world_size * num_chunks), hidden, pre_process=rank == 0 and c == 0)
            for c in range(num_chunks)
        ]
        schedule = get_forward_backward_func()
        for m in microbatches:
            samples = []
            for repeat in range(repeats + 1):  # the first is a warm-up
                data = [torch.randn(seq, batch, hidden) for _ in range(m)]
                iterators = [iter(data) for _ in chunks]
                dist.barrier()
                timer.seconds = 0.0
                p2p_counters.reset()
                start = time.perf_counter()
                schedule(
                    forward_step,
                    iterators if virtual_size else iterators[0],
                    chunks if virtual_size else chunks[0],
                    m,
                    seq,
                    batch,
                    tensor_shape=(seq, batch, hidden),
                    overlap_p2p_comm=overlap,
                )
                step = time.perf_counter() - start
                if repeat:
                    samples.append((step, timer.seconds, p2p_counters.bytes_sent))
            step, idle, sent = (statistics.median(column) for column in zip(*samples, strict=True))
            rows.append(
                {"v": num_chunks, "overlap": overlap, "m": m, "step": step, "idle": idle, "bytes_sent": sent}
            )
        state.destroy_model_parallel()
    return rows


def expected_bytes_sent(rank: int, p: int, v: int, m: int, message_bytes: int) -> int:
    """Each chunk sends m activations forward unless it is the last virtual stage, and m grads back unless
    it is the first."""
    forward_senders = v - (rank == p - 1)
    backward_senders = v - (rank == 0)
    return (forward_senders + backward_senders) * m * message_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    message_bytes = args.seq_length * args.micro_batch_size * args.hidden_size * 4
    print(
        f"{args.num_layers} Linear({args.hidden_size})+tanh layers, activations [s={args.seq_length}, "
        f"b={args.micro_batch_size}, h={args.hidden_size}] fp32, gloo, 1 thread per rank, {cores} cores, "
        f"median of {args.repeats} steps"
    )
    print(
        f"{'p':>2} {'schedule':>22} {'m':>3} {'step ms':>8} {'idle/compute':>12} {'theory':>7} "
        f"{'measured/theory':>15} {'MB sent/rank (closed form)':>27}"
    )
    one_f_one_b = {}  # p -> measured / theoretical bubble of 1F1B at the largest m
    for p in args.pipeline_sizes:
        results = run_distributed(
            measure,
            p,
            args.num_layers,
            args.microbatches,
            args.seq_length,
            args.micro_batch_size,
            args.hidden_size,
            args.repeats,
            timeout=600,
        )
        for i, row in enumerate(results[0]):
            v, m = row["v"], row["m"]
            per_rank = [ranks[i] for ranks in results]
            bubble = statistics.mean(r["idle"] / (r["step"] - r["idle"]) for r in per_rank)
            theory = (p - 1) / (v * m)
            sent = [r["bytes_sent"] for r in per_rank]
            expected = [expected_bytes_sent(rank, p, v, m, message_bytes) for rank in range(p)]
            traffic = "/".join(f"{b / 1e6:.2f}" for b in sent) + (
                " (=)" if sent == expected else " (DIFFERS)"
            )
            name = (
                ("1F1B " + ("overlapped" if row["overlap"] else "blocking")) if v == 1 else f"interleaved{v}"
            )
            print(
                f"{p:>2} {name:>22} {m:>3} {max(r['step'] for r in per_rank) * 1e3:>8.1f} {bubble:>12.3f} "
                f"{theory:>7.3f} {bubble / theory:>15.2f} {traffic:>27}"
            )
            if v == 1 and row["overlap"] and m == max(args.microbatches):
                one_f_one_b[p] = bubble / theory
    fitting = [p for p in one_f_one_b if p <= cores]
    p = max(fitting) if fitting else min(one_f_one_b)
    print(f"headline: 1F1B overlapped, p={p}, m={max(args.microbatches)}: measured / theoretical bubble")
    print(f"ratio: {one_f_one_b[p]:.3f}")


if __name__ == "__main__":
    main()
