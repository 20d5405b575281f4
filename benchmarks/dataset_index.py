"""Time building GPT document/sample/shuffle indices and blending indices: ours vs Megatron's algorithm.

Ours (vectorised numpy) runs at full scale: by default 20M samples of 2048 tokens over a synthetic
10M-sequence, ~10B-token dataset (only the sequence-length array is made; no .bin needed), and a
10M-sample blend of three datasets. The peer is Megatron's own algorithm ported line by line to Python
(`build_sample_idx` and `build_blending_indices` from helpers.cpp, the numpy document/shuffle index of
gpt_dataset.py): it runs on a 1/`--peer-divisor` slice with the same epochs and is extrapolated
linearly, since its loops cost the same per sample (a small slice stays in cache, so this flatters
the peer). Megatron itself runs those loops in C++; this peer is what a straightforward Python
implementation costs. Times are CPU seconds of this process (medians of `--repeats`), which the other
jobs on a shared machine disturb less than wall time.

    .venv/bin/python -m benchmarks.dataset_index [--num-samples 20000000] [--repeats 3]

Ends with `ratio: <peer_time / our_time>` (higher is better).
"""

from __future__ import annotations

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from megatron_train.data.indices import (  # noqa: E402
    build_blending_indices,
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    num_epochs_needed,
    separate_final_epoch_split,
)
from tests.helpers.gpt_dataset import reference_blend, reference_indices

SEED = 1234
BLEND_WEIGHTS = [0.5, 0.3, 0.2]


def our_gpt_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int) -> dict:
    """GPTDataset._build_indices without the dataset object: seconds spent on each index."""
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length, 1)
    sans_final = separate_final_epoch_split(tokens_per_epoch, num_epochs, num_samples, seq_length, 1)
    rng = np.random.RandomState(SEED)
    began = time.process_time()
    document_index = build_document_index(documents, num_epochs, rng, sans_final is not None)
    documented = time.process_time()
    sample_index = build_sample_index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch)
    sampled = time.process_time()
    built = sample_index.shape[0] - 1
    build_shuffle_index(built if sans_final is None else sans_final, built, rng)
    shuffled = time.process_time()
    return {
        "document index": documented - began,
        "sample index": sampled - documented,
        "shuffle index": shuffled - sampled,
        "total": shuffled - began,
    }


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.process_time()
        fn()
        times.append(time.process_time() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=20_000_000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--num-sequences", type=int, default=10_000_000)
    parser.add_argument("--blend-samples", type=int, default=10_000_000)
    parser.add_argument("--peer-divisor", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    sizes = np.clip(rng.lognormal(6.4, 0.9, args.num_sequences), 1, 32768).astype(np.int32)
    documents = np.arange(args.num_sequences, dtype=np.int32)
    print(
        f"synthetic data: {args.num_sequences:,} sequences, {int(sizes.sum(dtype=np.int64)):,} tokens; "
        f"{args.num_samples:,} samples of {args.seq_length} tokens"
    )

    runs = [our_gpt_indices(sizes, documents, args.num_samples, args.seq_length) for _ in range(args.repeats)]
    phases = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
    ours = phases.pop("total")
    subset_documents = documents[: args.num_sequences // args.peer_divisor]
    subset_samples = args.num_samples // args.peer_divisor
    ours_subset = statistics.median(
        our_gpt_indices(sizes, subset_documents, subset_samples, args.seq_length)["total"]
        for _ in range(args.repeats)
    )
    peer_subset = median_seconds(
        lambda: reference_indices(sizes, subset_documents, subset_samples, args.seq_length, SEED), 1
    )
    peer = peer_subset * args.peer_divisor
    print(f"GPT indices, ours at full scale:       {ours:8.2f} s")
    print("  " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items()))
    print("  (both shuffles are Megatron's own RandomState calls, kept so the sample order is identical)")
    print(
        f"GPT indices, 1/{args.peer_divisor} slice: ours {ours_subset:.3f} s, line-by-line port {peer_subset:.2f} s"
    )
    print(f"GPT indices, port extrapolated:        {peer:8.2f} s")

    ours_blend = median_seconds(
        lambda: build_blending_indices(BLEND_WEIGHTS, args.blend_samples), args.repeats
    )
    peer_blend = (
        median_seconds(lambda: reference_blend(BLEND_WEIGHTS, args.blend_samples // args.peer_divisor), 1)
        * args.peer_divisor
    )
    print(
        f"blending {args.blend_samples:,} samples of {len(BLEND_WEIGHTS)} datasets: ours {ours_blend:.2f} s, "
        f"port extrapolated {peer_blend:.2f} s"
    )
    print(
        "(CPU seconds of this process, median of repeats: wall time on the shared 2-core machine is noisier)"
    )
    print(f"ratio: {(peer + peer_blend) / (ours + ours_blend):.1f}")


if __name__ == "__main__":
    main()
