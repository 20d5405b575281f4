"""Mamba-2 on CPU: our mixer's forward + backward against `transformers`' Mamba-2 torch path, and generation with
our state cache against `transformers` `generate`.

Both sides hold the same weights (HF's random ones copied into ours; the script first checks that the mixers'
outputs agree and that both generate the same greedy tokens), run with the same thread count, and alternate
within each repeat so machine load hits both alike. Each library uses its own default chunk size (ours 128, HF's
256). Prints tokens/s (median of repeats) for training (forward + backward of one mixer) and for greedy
generation, and ends with `ratio: <ours/hf>` of the mixer's forward + backward, the figure with a target (1.5).

    .venv/bin/python -m benchmarks.mamba [--hidden 512 --state 64 --seq 512 --batch 2 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import transformers

from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.models.config import TransformerConfig
from megatron_train.models.hf_import import from_hf
from megatron_train.models.hf_mamba import mamba2_config, mamba2_rules
from megatron_train.models.hybrid import MambaModel
from megatron_train.tokenizer import build_tokenizer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--state", type=int, default=64)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2, help="layers of the generation model")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def hf_model(args: argparse.Namespace) -> torch.nn.Module:
    config = transformers.Mamba2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, state_size=args.state, num_hidden_layers=args.layers,
        num_heads=2 * args.hidden // args.head_dim, head_dim=args.head_dim, n_groups=args.groups, expand=2,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Mamba2ForCausalLM(config)


def our_model(hf: torch.nn.Module) -> MambaModel:
    """Ours with HF's weights, through the converter's mapping."""
    hf_config = hf.config.to_dict()
    config: TransformerConfig = mamba2_config(hf_config, "benchmark")
    ours = MambaModel(config, hf.config.vocab_size)
    ours.load_state_dict(from_hf(hf.state_dict(), mamba2_rules(config)), strict=True)
    return ours


def timed(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, alternating them within every repeat."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def mixer_pair(
    hf: torch.nn.Module, ours: MambaModel, args: argparse.Namespace
) -> dict[str, Callable[[], None]]:
    """Forward + backward of layer 0's mixer, each on its own copy of one input."""
    hf_mixer, our_mixer = hf.backbone.layers[0].mixer.train(), ours.decoder.layers[0].mixer.train()
    hidden = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_mixer(hidden)
        got = our_mixer(hidden.transpose(0, 1)).transpose(0, 1)
    error = float((got - expected).abs().max())
    assert error < 1e-3 * float(expected.abs().max()), f"the mixers disagree by {error}"

    def run(mixer: torch.nn.Module, layout: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            x = layout(hidden).detach().requires_grad_()
            mixer(x).sum().backward()

        return step

    return {"ours": run(our_mixer, lambda x: x.transpose(0, 1)), "hf": run(hf_mixer, lambda x: x)}


def generation_pair(
    hf: torch.nn.Module, ours: MambaModel, args: argparse.Namespace
) -> dict[str, Callable[[], list[list[int]]]]:
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=args.vocab - 1)
    generator = torch.Generator().manual_seed(2)
    prompt_ids = torch.randint(0, args.vocab - 1, (args.batch, args.prompt_tokens), generator=generator)
    prompts = [" ".join(map(str, row)) for row in prompt_ids.tolist()]
    params = GenerationParams(
        tokens_to_generate=args.new_tokens, top_k=1, use_eod_token_for_early_termination=False
    )
    ours.config.max_position_embeddings = args.prompt_tokens + args.new_tokens

    @torch.inference_mode()
    def run_hf() -> list[list[int]]:
        return hf.generate(
            prompt_ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        ).tolist()  # fmt: skip

    return {"ours": lambda: generate(ours.eval(), tokenizer, prompts, params).tokens, "hf": run_hf}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    hf = hf_model(args)
    ours = our_model(hf)
    heads = 2 * args.hidden // args.head_dim
    print(
        f"threads {args.threads}; Mamba-2 mixer: hidden {args.hidden}, {heads} heads of {args.head_dim}, state "
        f"{args.state}, {args.groups} group(s); median of {args.repeats} (timings are noisy on a shared machine)"
    )
    mixer = mixer_pair(hf, ours, args)
    for run in mixer.values():  # warm-up
        run()
    seconds = timed(mixer, args.repeats)
    train = {name: args.batch * args.seq / value for name, value in seconds.items()}
    train_ratio = train["ours"] / train["hf"]
    print(
        f"mixer forward + backward, batch {args.batch} x {args.seq} tokens: ours {train['ours']:9.1f} tokens/s | "
        f"hf {train['hf']:9.1f} tokens/s | ours/hf {train_ratio:.3f} (outputs agree)"
    )

    runs = generation_pair(hf.eval(), ours, args)
    ours_tokens, hf_tokens = runs["ours"](), runs["hf"]()  # also the warm-up
    assert ours_tokens == hf_tokens, "greedy tokens differ from transformers'"
    seconds = timed(runs, args.repeats)
    rate = {name: args.batch * args.new_tokens / value for name, value in seconds.items()}
    print(
        f"greedy generation, {args.layers} layers, batch {args.batch}, {args.prompt_tokens} + {args.new_tokens} "
        f"tokens: ours {rate['ours']:8.1f} tokens/s | hf {rate['hf']:8.1f} tokens/s | ours/hf "
        f"{rate['ours'] / rate['hf']:.3f} (greedy tokens identical)"
    )
    print(f"ratio: {train_ratio:.3f}")


if __name__ == "__main__":
    main()
