"""Training-step throughput: our GPTModel against transformers.GPT2LMHeadModel at an identical configuration.

One fwd + bwd + AdamW step (foreach, as megatron_train.optimizer builds it) on the same batch, fp32 and bf16
(CPU autocast), same thread count. The weights are copied from HF into ours and the logits checked equal
before any timing. Each repeat runs, back to back: our step, HF's step, a large square matmul (the machine's
matmul ceiling) and the model's own GEMMs (the ceiling at its shapes), so a shared machine's changing load
hits all of them alike; ratios are taken within a repeat, then the median over repeats.

Model FLOPs are Megatron's formula (megatron_train.training.flops: the logit layer included, causal attention
counted in full, no recompute), 3x the forward.

The default shape is GPT-2 small's width, heads and vocabulary (50257 padded to 50304) with 4 layers and
4 x 512 tokens, so one step is seconds on a few CPU cores; the logit layer is then 55% of the FLOPs (31% in
the 12-layer model). On CPU, fresh large buffers cost page faults: run with THP_MEM_ALLOC_ENABLE=1 (torch
then backs them with huge pages) to see the model rather than the kernel; the first line says which.
The last line is `ratio: <ours/hf>`: the geometric mean over dtypes of the tokens/s ratios.

    THP_MEM_ALLOC_ENABLE=1 .venv/bin/python -m benchmarks.train_step [--layers 4 --hidden 768 --repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers

from megatron_train.arguments import MegatronConfig
from megatron_train.data.config import DataConfig
from megatron_train.families.gpt import gpt_terms
from megatron_train.models import GPTModel, TransformerConfig
from megatron_train.models.hf_import import gpt2_state_dict_from_hf

SQUARE_N = 4096


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="default: all cores")
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    return parser.parse_args()


def build_config(args: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig.gpt2(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, seq_length=args.seq,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip


def build_pair(args: argparse.Namespace, config: TransformerConfig) -> tuple[GPTModel, torch.nn.Module]:
    """HF GPT-2 with random weights, and ours loaded from it; asserts equal logits before any timing."""
    hf_config = transformers.GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_config)
    hf.config._attn_implementation = "sdpa"  # HF's fastest CPU attention, the same kernel as ours
    ours = GPTModel(config, args.vocab)
    ours.load_state_dict(gpt2_state_dict_from_hf(hf.state_dict(), config), strict=True)
    ids = torch.randint(0, args.vocab, (2, args.seq))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), hf.eval()(ids).logits, rtol=1e-4, atol=1e-4)
    return ours.train(), hf.train()


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def make_step(model: torch.nn.Module, is_ours: bool, ids, labels, dtype: torch.dtype) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext():
            if is_ours:
                loss = model(ids, labels=labels).mean()
            else:  # the same loss work as ours: logits -> fp32 token cross entropy, no extra shift copy
                logits = model(ids).logits
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def model_gemm_shapes(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(m, k, n) of every GEMM in one step, attention's excepted: each linear's forward, input-grad and
    weight-grad products."""
    tokens, h = args.batch * args.seq, args.hidden
    linears = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)] * args.layers + [(h, args.vocab)]
    shapes = []
    for fan_in, fan_out in linears:
        shapes += [(tokens, fan_in, fan_out), (tokens, fan_out, fan_in), (fan_out, tokens, fan_in)]
    return shapes


def make_matmuls(shapes: list[tuple[int, int, int]], dtype: torch.dtype) -> tuple[Callable[[], None], float]:
    """A function running one torch.mm per (m, k, n) into preallocated outputs, and their total FLOPs."""
    operands = [
        (torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype), torch.empty(m, n, dtype=dtype))
        for m, k, n in shapes
    ]

    def run() -> None:
        for a, b, out in operands:
            torch.mm(a, b, out=out)

    return run, sum(2.0 * m * k * n for m, k, n in shapes)


def paired_median(numerators: list[float], denominators: list[float]) -> float:
    """Median over repeats of numerator / denominator taken within each repeat (robust to load drifting)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    config = build_config(args)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    tokens = args.batch * args.seq
    flops = (
        args.batch * gpt_terms(MegatronConfig(model=config, data=DataConfig()), args.vocab).flops_per_sample()
    )
    huge_pages = os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == "1"
    print(f"threads {args.threads}; GPT-2 shape: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}; {flops / 1e9:.0f} GFLOP per step (Megatron); "
          f"median of {args.repeats} repeats; huge pages (THP_MEM_ALLOC_ENABLE) {'on' if huge_pages else 'off'}; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    ratios = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        ours, hf = build_pair(args, config)
        square, square_flops = make_matmuls([(SQUARE_N, SQUARE_N, SQUARE_N)], torch.float32)
        shapes, shapes_flops = make_matmuls(model_gemm_shapes(args), dtype)
        runs = {
            "ours": timed(make_step(ours, True, ids, labels, dtype)),
            "hf": timed(make_step(hf, False, ids, labels, dtype)),
            "square_fp32": timed(square),
            "shapes": timed(shapes),
        }
        if dtype != torch.float32:
            runs["square_dtype"] = timed(make_matmuls([(SQUARE_N, SQUARE_N, SQUARE_N)], dtype)[0])
        for _ in range(args.warmup):
            for run in runs.values():
                run()
        seconds: dict[str, list[float]] = {key: [] for key in runs}
        for _ in range(args.repeats):
            for key, run in runs.items():
                seconds[key].append(run())

        ours_t, hf_t = seconds["ours"], seconds["hf"]
        ratio = paired_median(hf_t, ours_t)
        ratios.append(ratio)
        # Fraction of a ceiling = (FLOPs / our time) / (ceiling FLOPs / its time), paired within each repeat.
        of_square = paired_median(seconds["square_fp32"], ours_t) * flops / square_flops
        of_shapes = paired_median(seconds["shapes"], ours_t) * flops / shapes_flops
        line = (
            f"{name:>8}: ours {tokens / statistics.median(ours_t):7.1f} tok/s | "
            f"hf {tokens / statistics.median(hf_t):7.1f} tok/s | ours/hf {ratio:.3f} | "
            f"ours {flops / statistics.median(ours_t) / 1e9:.1f} GFLOP/s = {100 * of_square:.1f}% of the fp32 "
            f"{SQUARE_N}^3 matmul ({square_flops / statistics.median(seconds['square_fp32']) / 1e9:.0f} GFLOP/s), "
            f"{100 * of_shapes:.1f}% of its own GEMM shapes in {name} "
            f"({shapes_flops / statistics.median(seconds['shapes']) / 1e9:.0f} GFLOP/s)"
        )
        if dtype != torch.float32:
            of_dtype = paired_median(seconds["square_dtype"], ours_t) * flops / square_flops
            line += f", {100 * of_dtype:.1f}% of the {name} {SQUARE_N}^3 matmul"
        print(line, flush=True)
    print(f"ratio: {statistics.geometric_mean(ratios):.3f}")


if __name__ == "__main__":
    main()
