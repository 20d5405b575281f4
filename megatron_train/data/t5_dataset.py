"""T5 span corruption on sentence-split WordPiece data, laid out as Megatron-Core's T5MaskedWordPieceDataset.

A sample's sentences are joined and cut to the target length; random spans covering
`masking_probability` of the tokens (mean length `mean_span_length`) are each replaced in the encoder
input by one sentinel `<extra_id_k>` (k counting up from 0), and the decoder learns to emit
`<extra_id_0> span_0 <extra_id_1> span_1 ... [EOS]` from the input `[BOS] <extra_id_0> span_0 ...`.

The spans come from T5's `random_spans_noise_mask` (the T5 paper's span corruption), not from Megatron's
whole-word geometric n-grams (p = 0.2, up to 10 words), whose spans average about 4.5 words: this is
what makes the noise density and the mean span length the configured ones (docs/architecture.md).
One change to T5's algorithm: the span count `noise / mean_span_length` is rounded at random (up with
the probability of its fraction) rather than to nearest, so the mean span length is the configured
one at every sequence length instead of, e.g., 3.17 at 126 tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_train.data.masked_dataset import MaskedDatasetConfig, MaskedWordPieceDataset


@dataclass(frozen=True, kw_only=True)
class T5DatasetConfig(MaskedDatasetConfig):
    """T5 samples: `seq_length` is --encoder-seq-length; the tokenizer needs --vocab-extra-ids sentinels."""

    decoder_seq_length: int
    mean_span_length: float = 3.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_special_tokens("bos", "eos")
        if self.seq_length < 3:
            raise ValueError(f"--encoder-seq-length must be >= 3, got {self.seq_length}")
        if self.mean_span_length < 1:
            raise ValueError(f"mean_span_length must be >= 1, got {self.mean_span_length}")
        max_noise = max_noise_tokens(self.seq_length - 2, self.masking_probability)
        max_spans = math.ceil(max_noise / self.mean_span_length)
        sentinels = len(self.tokenizer.additional_special_tokens_ids)
        if sentinels < max_spans:
            raise ValueError(
                f"--vocab-extra-ids {sentinels}: a sample of --encoder-seq-length {self.seq_length} may hold "
                f"{max_spans} masked spans, each needing its own sentinel; give --vocab-extra-ids {max_spans} "
                "or more (T5 uses 100)"
            )
        if self.decoder_seq_length < 1 + max_noise + max_spans:
            raise ValueError(
                f"--decoder-seq-length {self.decoder_seq_length} is too short for the up to {max_noise} masked "
                f"tokens and {max_spans} sentinels of --encoder-seq-length {self.seq_length} (plus [BOS]); "
                f"give --decoder-seq-length {1 + max_noise + max_spans} or more"
            )


def max_noise_tokens(length: int, noise_density: float) -> int:
    """How many of `length` tokens T5's span corruption masks: round(length * density), within [1, length-1]."""
    length = max(length, 2)
    return min(max(int(round(length * noise_density)), 1), length - 1)


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.RandomState) -> np.ndarray:
    """T5's `_random_segmentation`: `num_items` split into `num_segments` non-empty runs, uniformly."""
    first_in_segment = np.arange(num_items - 1) < num_segments - 1
    rng.shuffle(first_in_segment)
    segment_ids = np.cumsum(np.concatenate(([0], first_in_segment)))
    return np.bincount(segment_ids, minlength=num_segments)


def random_noise_spans(
    length: int, noise_density: float, mean_span_length: float, rng: np.random.RandomState
) -> list[tuple[int, int]]:
    """T5's `random_spans_noise_mask` as [start, end) spans: noise and kept runs alternate, kept first."""
    num_noise = max_noise_tokens(length, noise_density)
    expected_spans = num_noise / mean_span_length
    num_spans = int(expected_spans) + int(rng.random() < expected_spans - int(expected_spans))
    num_spans = max(1, min(num_spans, num_noise, max(length, 2) - num_noise))
    noise_lengths = _random_segmentation(num_noise, num_spans, rng)
    kept_lengths = _random_segmentation(max(length, 2) - num_noise, num_spans, rng)
    spans, position = [], 0
    for kept, noise in zip(kept_lengths.tolist(), noise_lengths.tolist(), strict=True):
        position += kept
        spans.append((position, min(position + noise, length)))
        position += noise
    return [(start, end) for start, end in spans if start < end]


class T5Dataset(MaskedWordPieceDataset):
    """Item i: `text_enc, text_dec, labels, loss_mask, truncated, enc_mask, dec_mask`.

    `labels` is the decoder output (-1 past it); `loss_mask` is 1 on its tokens. The masks are current
    Megatron-Core's 1-D ones, 1 on tokens and 0 on padding (`enc_mask` [enc], `dec_mask` [dec]): the model
    makes its attention masks from them (the decoder's causal), rather than a sample carrying [s, s] masks
    (2.7 MB at 512/128).
    """

    config: T5DatasetConfig

    def max_target_length(self) -> int:
        return self.config.seq_length - 2  # Megatron's room for [BOS] and [EOS]

    def min_sentences(self) -> int:
        return 1

    def __getitem__(self, idx: int) -> dict[str, np.ndarray | int]:
        sentences, target_length, rng = self.sample_sentences(idx)
        config, tokenizer = self.config, self.config.tokenizer
        tokens = [token for sentence in sentences for token in sentence]
        truncated = len(tokens) > target_length
        tokens = tokens[:target_length]

        spans = random_noise_spans(len(tokens), config.masking_probability, config.mean_span_length, rng)
        sentinels = tokenizer.additional_special_tokens_ids
        encoder_input: list[int] = []
        decoder_input = [tokenizer.bos]
        decoder_output: list[int] = []
        begin = 0
        for sentinel, (start, end) in zip(sentinels, spans, strict=False):
            encoder_input += [*tokens[begin:start], sentinel]
            decoder_input += [sentinel, *tokens[start:end]]
            decoder_output += [sentinel, *tokens[start:end]]
            begin = end
        encoder_input += tokens[begin:]
        decoder_output.append(tokenizer.eos)

        encoder_length, decoder_length = config.seq_length, config.decoder_seq_length
        text_enc = _padded(encoder_input, encoder_length, 0)
        text_dec = _padded(decoder_input, decoder_length, 0)
        labels = _padded(decoder_output, decoder_length, -1)
        loss_mask = _padded([1] * len(decoder_input), decoder_length, 0)
        return {
            "text_enc": text_enc,
            "text_dec": text_dec,
            "labels": labels,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
            "enc_mask": _padded([1] * len(encoder_input), encoder_length, 0),
            "dec_mask": loss_mask.copy(),
        }


def _padded(values: list[int], length: int, fill: int) -> np.ndarray:
    """`values` as int64, padded with `fill` to `length`."""
    array = np.full(length, fill, dtype=np.int64)
    array[: len(values)] = values
    return array
