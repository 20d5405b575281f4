"""Retro greedy generation with the decoder's KV cache against the same generation without it (Megatron's Retro
generation reruns the whole text at every token), through the server's path (`generate` on a `RetrievingModel`).

One random Retro model (decoder of `--layers` layers, chunked cross-attention from layer 6 every 3rd, 2 encoder
layers), one in-memory database of random chunks with an exact index over bag-of-tokens embeddings (so retrieval
costs little and the same in both: each chunk is retrieved for once, when it is complete). The script first
checks that both give the same greedy tokens; the two alternate within each repeat. Prints tokens/s (median of
repeats) per batch size and ends with `ratio: <cached/uncached>`, the geometric mean over batch sizes.

    .venv/bin/python -m benchmarks.retro_generate [--layers 12 --hidden 256 --new-tokens 256 --batch-sizes 1 4]
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time

import faiss
import numpy as np
import torch

from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.models import TransformerConfig
from megatron_train.models.retro import RetroModel
from megatron_train.models.retro_config import RetroConfig
from megatron_train.tokenizer import build_tokenizer
from retro.retrieval import Retriever, RetrievingModel

EMBED_DIM = 64


class RandomChunks:
    """A chunk database of random token chunks (what `RetroDataset` and the retriever read of one)."""

    def __init__(self, chunks: np.ndarray) -> None:
        self.chunks = chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def chunk_tokens(self, chunk_id: int) -> np.ndarray:
        return self.chunks[chunk_id]


def bag_of_tokens(texts: list[str]) -> np.ndarray:
    """float32 [n, EMBED_DIM]: token counts hashed into buckets (a cheap stand-in for the BERT embedder)."""
    vectors = np.zeros((len(texts), EMBED_DIM), dtype=np.float32)
    for row, text in enumerate(texts):
        for token in text.split():
            vectors[row, int(token) % EMBED_DIM] += 1.0
    return vectors


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--chunk-length", type=int, default=64)
    parser.add_argument("--neighbours", type=int, default=2)
    parser.add_argument("--database-chunks", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def build_model(args: argparse.Namespace) -> RetrievingModel:
    """A random Retro model behind a retriever over a random in-memory database."""
    positions = args.prompt_tokens + args.new_tokens
    config = TransformerConfig.gpt2(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        seq_length=positions + args.chunk_length, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    retro = RetroConfig(
        retro_chunk_length=args.chunk_length, retro_num_neighbors=args.neighbours,
        retro_encoder_hidden_dropout=0.0, retro_encoder_attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = RetroModel(config, args.vocab, retro=retro).eval()
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=args.vocab - 1)
    rng = np.random.default_rng(0)
    chunks = rng.integers(0, args.vocab - 1, (args.database_chunks, args.chunk_length))
    index = faiss.IndexFlatL2(EMBED_DIM)
    index.add(bag_of_tokens([" ".join(map(str, chunk)) for chunk in chunks]))
    retriever = Retriever(
        RandomChunks(chunks), index, bag_of_tokens, tokenizer, args.chunk_length, args.neighbours,
        retro.retro_num_retrieved_chunks,
    )  # fmt: skip
    return RetrievingModel(model, retriever).eval()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args)
    tokenizer = model.retriever.gpt_tokenizer
    print(
        f"threads {args.threads}; Retro decoder {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"vocab {args.vocab}, chunks of {args.chunk_length}, {args.neighbours} neighbours; prompt "
        f"{args.prompt_tokens} tokens + {args.new_tokens} new, greedy; median of {args.repeats}"
    )
    ratios = []
    for batch_size in args.batch_sizes:
        generator = torch.Generator().manual_seed(batch_size)
        prompt_ids = torch.randint(0, args.vocab - 1, (batch_size, args.prompt_tokens), generator=generator)
        prompts = [" ".join(map(str, row)) for row in prompt_ids.tolist()]
        params = {
            name: GenerationParams(
                tokens_to_generate=args.new_tokens, top_k=1, use_eod_token_for_early_termination=False,
                use_kv_cache=name == "cached",
            )
            for name in ("cached", "uncached")
        }  # fmt: skip
        runs = {
            name: functools.partial(lambda p, texts: generate(model, tokenizer, texts, p).tokens, p, prompts)
            for name, p in params.items()
        }
        tokens = {name: run() for name, run in runs.items()}  # also the warm-up
        assert tokens["cached"] == tokens["uncached"], "the KV cache changed the greedy tokens"
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        rate = {name: batch_size * args.new_tokens / statistics.median(t) for name, t in times.items()}
        ratios.append(rate["cached"] / rate["uncached"])
        print(
            f"batch {batch_size}: with the KV cache {rate['cached']:8.1f} tokens/s | without "
            f"{rate['uncached']:8.1f} tokens/s | cached/uncached {ratios[-1]:.2f} (greedy tokens identical)"
        )
    print(f"ratio: {math.exp(statistics.mean(math.log(r) for r in ratios)):.3f}")


if __name__ == "__main__":
    main()
