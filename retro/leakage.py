"""The Retro paper's leakage analysis (Borgeaud et al. 2021, section 2.6): how much of each predicted chunk its
neighbours already hold, and the loss per overlap bucket.

A sample of ns tokens is l chunks of m tokens. The tokens of chunk u >= 1 are predicted at positions u*m - 1 ..
(u+1)*m - 2, exactly the positions whose chunked cross-attention reads the neighbours retrieved for chunk u - 1
(`megatron_train.models.retro`); chunk 0 is predicted without retrieval and is not analysed. A chunk's overlap is
the paper's r(C): the length of its longest common token substring with any of those neighbours (each neighbour
chunk with its continuation, as the model reads them), over the chunk length. A chunk the database holds
verbatim has overlap 1; a chunk whose neighbours say nothing of it, near 0.

Losses are per predicted chunk (nats per token), so Retro's and the GPT's are compared on the same chunks;
bits per byte divide the chunks' summed loss by ln 2 and their UTF-8 bytes (the tokenizer's detokenized text),
over all chunks ("unfiltered") and over those whose overlap is at most `filter_overlap` ("filtered": what the
model scores where the database does not already hold the text). See docs/architecture.md (Retro flow).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# Bucket edges of the overlap r(C): [0, 1/8), [1/8, 1/4), [1/4, 1/2), [1/2, 3/4), [3/4, 1].
OVERLAP_EDGES = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)


def longest_common_substring(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest run of tokens that `a` and `b` (1-D token arrays) share, contiguous in both."""
    best = 0
    previous = np.zeros(len(b) + 1, dtype=np.int64)
    for token in a:
        current = np.zeros_like(previous)
        current[1:] = np.where(b == token, previous[:-1] + 1, 0)
        best = max(best, int(current.max()))
        previous = current
    return best


def chunk_overlaps(tokens: np.ndarray, neighbours: np.ndarray, chunk_length: int) -> np.ndarray:
    """float [l - 1]: r(C) of chunks 1 .. l - 1 of `tokens` [l * m] against the neighbours retrieved for the chunk
    before each, `neighbours` [l, k, r] (a missing neighbour is padding that matches nothing real)."""
    chunks = len(tokens) // chunk_length
    overlaps = np.zeros(chunks - 1)
    for u in range(1, chunks):
        chunk = tokens[u * chunk_length : (u + 1) * chunk_length]
        longest = max(longest_common_substring(chunk, neighbour) for neighbour in neighbours[u - 1])
        overlaps[u - 1] = longest / chunk_length
    return overlaps


def chunk_losses(token_losses: np.ndarray, chunk_length: int) -> np.ndarray:
    """float [l - 1]: the mean loss of predicting chunk u's tokens (positions u*m - 1 .. (u+1)*m - 2) for u >= 1,
    from one sample's per-position losses [l * m]."""
    chunks = len(token_losses) // chunk_length
    return np.array(
        [token_losses[u * chunk_length - 1 : (u + 1) * chunk_length - 1].mean() for u in range(1, chunks)]
    )


@dataclass(frozen=True)
class LeakageChunks:
    """Every analysed chunk: its overlap, its UTF-8 bytes, and each model's mean loss on it (nats per token)."""

    overlap: np.ndarray
    num_bytes: np.ndarray
    losses: dict[str, np.ndarray]
    chunk_length: int

    @classmethod
    def collect(
        cls,
        samples: Sequence[tuple[np.ndarray, np.ndarray]],
        token_losses: dict[str, np.ndarray],
        chunk_length: int,
        detokenize: Callable[[list[int]], str],
    ) -> LeakageChunks:
        """From (tokens [l * m], neighbours [l, k, r]) per sample and each model's per-position losses
        [samples, l * m] on the same samples."""
        overlap, num_bytes = [], []
        for tokens, neighbours in samples:
            overlap.append(chunk_overlaps(tokens, neighbours, chunk_length))
            chunks = len(tokens) // chunk_length
            num_bytes += [
                len(detokenize(tokens[u * chunk_length : (u + 1) * chunk_length].tolist()).encode())
                for u in range(1, chunks)
            ]
        losses = {
            name: np.concatenate([chunk_losses(row, chunk_length) for row in per_token])
            for name, per_token in token_losses.items()
        }
        return cls(np.concatenate(overlap), np.array(num_bytes), losses, chunk_length)

    def buckets(self, edges: Sequence[float] = OVERLAP_EDGES) -> list[dict]:
        """Per overlap bucket [low, high) (the last one closed): chunk count and each model's mean loss."""
        rows = []
        for i, (low, high) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
            last = i == len(edges) - 2
            inside = (self.overlap >= low) & ((self.overlap <= high) if last else (self.overlap < high))
            rows.append({
                "low": low,
                "high": high,
                "chunks": int(inside.sum()),
                **{name: float(loss[inside].mean()) if inside.any() else None for name, loss in self.losses.items()},
            })  # fmt: skip
        return rows

    def bits_per_byte(self, filter_overlap: float) -> dict[str, dict[str, float]]:
        """Each model's bits per byte over all chunks and over those with overlap <= `filter_overlap`."""
        kept = self.overlap <= filter_overlap
        result = {}
        for name, loss in self.losses.items():
            nats = loss * self.chunk_length
            result[name] = {
                "unfiltered": float(nats.sum() / math.log(2) / self.num_bytes.sum()),
                "filtered": float(nats[kept].sum() / math.log(2) / max(self.num_bytes[kept].sum(), 1)),
            }
        return result
