"""The Retro paper's leakage analysis (`retro.leakage`): a chunk's overlap with the neighbours retrieved for the
chunk before it, the loss of predicting each chunk, losses per overlap bucket and bits per byte."""

from __future__ import annotations

import math

import numpy as np
import pytest

from retro.leakage import LeakageChunks, chunk_losses, chunk_overlaps, longest_common_substring


def test_longest_common_substring_counts_a_contiguous_run_in_both():
    assert longest_common_substring(np.array([1, 2, 3, 4]), np.array([9, 2, 3, 4, 9])) == 3
    assert (
        longest_common_substring(np.array([1, 2, 3, 4]), np.array([1, 9, 2, 9, 3])) == 1
    )  # not a subsequence
    assert longest_common_substring(np.array([5, 6]), np.array([7, 8])) == 0


def test_a_chunk_is_compared_with_the_neighbours_of_the_chunk_before_it():
    tokens = np.arange(12)  # 3 chunks of 4
    neighbours = np.full((3, 2, 8), 99)  # [chunks, k, r]
    neighbours[0, 1, 2:6] = [4, 5, 6, 7]  # chunk 0's second neighbour holds chunk 1 whole
    neighbours[1, 0, :2] = [9, 10]  # chunk 1's first holds 2 of chunk 2's tokens in a row
    neighbours[2, 0, :4] = [8, 9, 10, 11]  # chunk 2's own neighbours predict nothing in this sample
    np.testing.assert_allclose(chunk_overlaps(tokens, neighbours, 4), [1.0, 0.5])
    # chunk u's tokens are predicted at positions u*m - 1 .. (u+1)*m - 2
    losses = np.arange(12, dtype=float)
    np.testing.assert_allclose(chunk_losses(losses, 4), [np.mean([3, 4, 5, 6]), np.mean([7, 8, 9, 10])])


def test_buckets_and_bits_per_byte_by_hand():
    chunks = LeakageChunks(
        overlap=np.array([0.0, 0.1, 0.5, 1.0]),
        num_bytes=np.array([10, 10, 20, 20]),
        losses={"retro": np.array([2.0, 2.0, 1.0, 0.0]), "gpt": np.array([2.0, 2.0, 2.0, 2.0])},
        chunk_length=4,
    )
    rows = {(row["low"], row["high"]): row for row in chunks.buckets()}
    assert rows[(0.0, 0.125)]["chunks"] == 2 and rows[(0.0, 0.125)]["retro"] == 2.0
    assert (
        rows[(0.5, 0.75)]["retro"] == 1.0 and rows[(0.75, 1.0)]["retro"] == 0.0
    )  # the last bucket is closed
    assert rows[(0.25, 0.5)]["chunks"] == 0 and rows[(0.25, 0.5)]["gpt"] is None
    bpb = chunks.bits_per_byte(0.125)
    assert bpb["gpt"]["unfiltered"] == pytest.approx(4 * 2.0 * 4 / math.log(2) / 60)
    assert bpb["retro"]["unfiltered"] == pytest.approx((8 + 8 + 4 + 0) / math.log(2) / 60)
    assert bpb["retro"]["filtered"] == pytest.approx(16 / math.log(2) / 20)  # the two chunks at r <= 1/8


def test_collect_reads_overlaps_bytes_and_losses_from_samples():
    tokens = np.arange(8)
    neighbours = np.full((2, 1, 8), 99)
    neighbours[0, 0, 4:8] = [4, 5, 6, 7]
    losses = {"retro": np.ones((1, 8)), "gpt": np.full((1, 8), 3.0)}
    chunks = LeakageChunks.collect([(tokens, neighbours)], losses, 4, lambda ids: "x" * len(ids) * 2)
    assert chunks.overlap.tolist() == [1.0] and chunks.num_bytes.tolist() == [8]
    assert chunks.losses["gpt"].tolist() == [3.0]
