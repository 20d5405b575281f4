"""Training-step throughput: our GPTModel against transformers.GPT2LMHeadModel at an identical configuration.

One fwd + bwd + AdamW step on the same batch, fp32 and bf16 (CPU autocast), same thread count; the two
models alternate within each repeat so machine load hits both alike. Reports tokens/s (median of repeats),
our achieved model FLOP/s by Megatron's formula against the machine's fp32 (and bf16) matmul ceilings,
timed between the steps.
The last line is `ratio: <ours/hf>`: the geometric mean over dtypes of the tokens/s ratios.

    .venv/bin/python -m benchmarks.train_step [--layers 4 --hidden 256 --seq 256 --batch 4 --repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers

from megatron_train.models import GPTModel, TransformerConfig
from megatron_train.models.hf_import import gpt2_state_dict_from_hf


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def build_pair(args: argparse.Namespace) -> tuple[GPTModel, torch.nn.Module]:
    """HF GPT-2 with random weights, and ours loaded from it; asserts equal logits before any timing."""
    hf_config = transformers.GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
    )  # fmt: skip
    config = TransformerConfig.gpt2(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, seq_length=args.seq,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_config)
    hf.config._attn_implementation = "sdpa"  # HF's fastest CPU attention, same kernel as ours
    ours = GPTModel(config, args.vocab)
    ours.load_state_dict(gpt2_state_dict_from_hf(hf.state_dict(), config), strict=True)
    ids = torch.randint(0, args.vocab, (2, args.seq))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), hf.eval()(ids).logits, rtol=1e-4, atol=1e-4)
    return ours.train(), hf.train()


def make_step(model: torch.nn.Module, is_ours: bool, ids, labels, dtype: torch.dtype) -> Callable[[], float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()

    def step() -> float:
        start = time.perf_counter()
        with autocast:
            if is_ours:
                loss = model(ids, labels=labels).mean()
            else:  # the same loss work as ours: logits -> token cross entropy, no extra shift copy
                logits = model(ids).logits
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


MATMUL_N = 2048


def make_matmul(dtype: torch.dtype) -> Callable[[], float]:
    """One timed MATMUL_N^3 torch.mm: the machine's matmul ceiling, sampled between the training steps so
    the shared machine's changing load affects it as it affects them."""
    a, b = torch.randn(MATMUL_N, MATMUL_N, dtype=dtype), torch.randn(MATMUL_N, MATMUL_N, dtype=dtype)

    def matmul() -> float:
        start = time.perf_counter()
        torch.mm(a, b)
        return time.perf_counter() - start

    return matmul


def megatron_flops_per_step(args: argparse.Namespace) -> float:
    """Megatron's model FLOPs per fwd+bwd (no recompute): 72 B s l h^2 (1 + s / 6h + V / 12hl)."""
    b, s, layers, h, v = args.batch, args.seq, args.layers, args.hidden, args.vocab
    return 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    tokens = args.batch * args.seq
    flops = megatron_flops_per_step(args)
    print(f"threads {args.threads}; GPT-2 shape: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}; median of {args.repeats} steps")  # fmt: skip
    ratios = []
    for dtype in (torch.float32, torch.bfloat16):
        ours, hf = build_pair(args)
        steps = {
            "ours": make_step(ours, True, ids, labels, dtype),
            "hf": make_step(hf, False, ids, labels, dtype),
            "matmul_fp32": make_matmul(torch.float32),
            "matmul_dtype": make_matmul(dtype),
        }
        for _ in range(args.warmup):
            for step in steps.values():
                step()
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.repeats):
            for name, step in steps.items():
                times[name].append(step())
        median = {name: statistics.median(t) for name, t in times.items()}
        throughput = {name: tokens / median[name] for name in ("ours", "hf")}
        achieved = flops * throughput["ours"] / tokens
        ceiling = {name: 2 * MATMUL_N**3 / median[name] for name in ("matmul_fp32", "matmul_dtype")}
        ratio = throughput["ours"] / throughput["hf"]
        ratios.append(ratio)
        name = str(dtype).removeprefix("torch.")
        print(f"{name:>8}: ours {throughput['ours']:9.1f} tok/s | hf {throughput['hf']:9.1f} tok/s | "
              f"ours/hf {ratio:.3f} | ours {achieved / 1e9:.1f} GFLOP/s = "
              f"{100 * achieved / ceiling['matmul_fp32']:.1f}% of fp32 matmul "
              f"({ceiling['matmul_fp32'] / 1e9:.0f} GFLOP/s)"
              + (f", {100 * achieved / ceiling['matmul_dtype']:.1f}% of {name} matmul "
                 f"({ceiling['matmul_dtype'] / 1e9:.0f} GFLOP/s)" if dtype != torch.float32 else ""))  # fmt: skip
    print(f"ratio: {statistics.geometric_mean(ratios):.3f}")


if __name__ == "__main__":
    main()
