"""Greedy generation throughput with a KV cache: ours against `transformers` GPT2LMHeadModel.generate.

Both run an identical GPT-2 shaped model (HF's random weights copied into our GPTModel; the script first checks
that the two generate the same greedy tokens), same prompts, same thread count, fixed number of new tokens
(no early stop). The two alternate within each repeat so machine load hits both alike. Prints tokens/s
(median of repeats) per batch size and ends with `ratio: <ours/hf>`, the geometric mean over batch sizes.

    .venv/bin/python -m benchmarks.generate [--layers 4 --hidden 256 --new-tokens 128 --batch-sizes 1 8 --threads 1]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import transformers

from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.models import GPTModel, TransformerConfig
from megatron_train.models.hf_import import gpt2_state_dict_from_hf
from megatron_train.tokenizer import build_tokenizer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def build_pair(args: argparse.Namespace) -> tuple[GPTModel, torch.nn.Module]:
    """HF GPT-2 with random weights and ours loaded from it, both in eval mode."""
    positions = args.prompt_tokens + args.new_tokens
    hf_config = transformers.GPT2Config(
        vocab_size=args.vocab, n_positions=positions, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    config = TransformerConfig.gpt2(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, seq_length=positions,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    hf.config._attn_implementation = "sdpa"  # HF's fastest CPU attention, the same kernel as ours
    ours = GPTModel(config, args.vocab)
    ours.load_state_dict(gpt2_state_dict_from_hf(hf.state_dict(), config), strict=True)
    return ours.eval(), hf


def make_runners(ours, hf, tokenizer, params: GenerationParams, prompt_ids: torch.Tensor):
    """Two functions generating from the same prompts, each returning prompt + new token ids per row."""
    prompts = [" ".join(map(str, row)) for row in prompt_ids.tolist()]

    def run_ours() -> list[list[int]]:
        return generate(ours, tokenizer, prompts, params).tokens

    @torch.inference_mode()
    def run_hf() -> list[list[int]]:
        return hf.generate(
            prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=params.tokens_to_generate,
            min_new_tokens=params.tokens_to_generate, do_sample=False, eos_token_id=None, pad_token_id=0,
        ).tolist()  # fmt: skip

    return run_ours, run_hf


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    ours, hf = build_pair(args)
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=args.vocab - 1)  # ids are the text; eod unused
    params = GenerationParams(
        tokens_to_generate=args.new_tokens, top_k=1, use_eod_token_for_early_termination=False
    )
    print(
        f"threads {args.threads}; GPT-2 shape: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"vocab {args.vocab}; prompt {args.prompt_tokens} tokens + {args.new_tokens} new, greedy; "
        f"median of {args.repeats} (timings are noisy on a shared machine)"
    )
    ratios = []
    for batch_size in args.batch_sizes:
        generator = torch.Generator().manual_seed(batch_size)
        prompt_ids = torch.randint(0, args.vocab - 1, (batch_size, args.prompt_tokens), generator=generator)
        run_ours, run_hf = make_runners(ours, hf, tokenizer, params, prompt_ids)
        ours_tokens, hf_tokens = run_ours(), run_hf()  # also the warm-up
        same = sum(a == b for a, b in zip(ours_tokens, hf_tokens, strict=True))
        assert same == batch_size, (
            f"greedy outputs differ from HF's on {batch_size - same} of {batch_size} rows"
        )
        times = {"ours": [], "hf": []}
        for _ in range(args.repeats):
            for name, run in (("ours", run_ours), ("hf", run_hf)):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        rate = {name: batch_size * args.new_tokens / statistics.median(t) for name, t in times.items()}
        ratios.append(rate["ours"] / rate["hf"])
        print(
            f"batch {batch_size}: ours {rate['ours']:8.1f} tokens/s | hf {rate['hf']:8.1f} tokens/s | "
            f"ours/hf {ratios[-1]:.3f} (greedy tokens identical)"
        )
    print(f"ratio: {math.exp(statistics.mean(math.log(r) for r in ratios)):.3f}")


if __name__ == "__main__":
    main()
