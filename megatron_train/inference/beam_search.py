"""Beam search for one prompt (Megatron's beam_search_and_post_process, its server's `beam_width`).

The hypotheses rule is the one Megatron took from Hugging Face and Hugging Face keeps: at each step the
2 x beam best continuations of all beams are ranked; those among the first `beam` that end in the stop token
become finished hypotheses scored sum(logprobs) / generated_length ** length_penalty (the stop token counted),
the best `beam` others continue. Search stops when `beam` hypotheses are finished and the best running beam,
scored at the current length, cannot beat the worst of them (`transformers`' `early_stopping=False`), or at
`tokens_to_generate`, where the best continuations are finished as they are. Under pipeline parallelism the
last stage decides and broadcasts its choices; every stage reorders its cache by them (a hybrid model's conv and
SSM states with its keys and values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_train.inference.forward import broadcast_from_last_stage
from megatron_train.inference.generation import (
    NON_FINITE,
    NonFiniteLogitsError,
    allocate_kv_cache,
    check_fits,
    finite_rows,
    vocab_logits,
)
from megatron_train.tokenizer.base import MegatronTokenizer


@dataclass(frozen=True)
class BeamSearchParams:
    """Names follow Megatron's server request: `beam_width`, `length_penalty`, `stop_token`."""

    beam_width: int
    tokens_to_generate: int = 64
    length_penalty: float = 1.0
    stop_token: int | None = None  # None: the tokenizer's eod
    add_BOS: bool = False

    def validate(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.tokens_to_generate < 1:
            raise ValueError(f"beam search needs tokens_to_generate >= 1, got {self.tokens_to_generate}")


@dataclass
class BeamSearchOutput:
    """The finished hypotheses, best first: prompt + generated tokens, their text and segments, and scores."""

    tokens: list[list[int]]
    texts: list[str]
    segments: list[list[str]]
    scores: list[float]


class _Finished:
    """The best `size` finished hypotheses as (score, tokens)."""

    def __init__(self, size: int, length_penalty: float) -> None:
        self.size = size
        self.length_penalty = length_penalty
        self.hypotheses: list[tuple[float, list[int]]] = []

    def add(self, tokens: list[int], sum_logprobs: float, generated: int) -> None:
        self.hypotheses.append((sum_logprobs / generated**self.length_penalty, tokens))
        self.hypotheses.sort(key=lambda hypothesis: -hypothesis[0])
        del self.hypotheses[self.size :]

    def cannot_improve(self, best_running: float, generated: int) -> bool:
        full = len(self.hypotheses) == self.size
        return full and best_running / generated**self.length_penalty <= self.hypotheses[-1][0]


@torch.inference_mode()
def beam_search(
    model: torch.nn.Module, tokenizer: MegatronTokenizer, prompt: str, params: BeamSearchParams
) -> BeamSearchOutput:
    """The `beam_width` best continuations of `prompt`, best first."""
    params.validate()
    beam = params.beam_width
    ids = ([tokenizer.eod] if params.add_BOS else []) + tokenizer.tokenize(prompt)
    if not ids:
        raise ValueError("the prompt is empty: pass add_BOS=True to search from an empty prompt")
    device = next(model.parameters()).device
    prompt_length, total_length = len(ids), len(ids) + params.tokens_to_generate
    tokens = torch.full((beam, total_length), tokenizer.eod, device=device)
    tokens[:, :prompt_length] = torch.tensor(ids, device=device)
    check_fits(model, tokens)
    stop_token = tokenizer.eod if params.stop_token is None else params.stop_token
    kv_cache = allocate_kv_cache(model, beam, total_length)
    positions = torch.arange(total_length, device=device).expand(beam, -1)
    running_scores = torch.full((beam,), float("-inf"), device=device)
    running_scores[0] = 0.0  # the beams start equal: continue from the first only
    finished = _Finished(beam, params.length_penalty)
    previous = 0
    was_training = model.training
    model.eval()
    try:
        for context_length in range(prompt_length, total_length):
            logits = vocab_logits(
                model,
                tokens[:, previous:context_length],
                positions[:, previous:context_length],
                kv_cache,
                tokenizer.vocab_size,
            )
            choice = None  # [beam ids to continue; their new tokens; 1 when the search is over]
            if logits is not None and not bool(finite_rows(logits[:, -1]).all()):
                choice = torch.full((2 * beam + 1,), NON_FINITE, dtype=torch.long, device=device)
            elif logits is not None:
                generated = context_length + 1 - prompt_length
                candidates = F.log_softmax(logits[:, -1], dim=-1) + running_scores[:, None]
                top_scores, top_indices = candidates.view(-1).topk(2 * beam)
                beam_ids, words = top_indices // candidates.size(1), top_indices % candidates.size(1)
                last_step = context_length + 1 == total_length
                ends = (words == stop_token) | last_step
                for rank in range(beam):
                    if ends[rank]:
                        row = tokens[beam_ids[rank], :context_length].tolist() + [int(words[rank])]
                        finished.add(row, float(top_scores[rank]), generated)
                keep = (top_scores - ends.float() * 1e9).topk(beam).indices
                running_scores = top_scores[keep]
                over = last_step or finished.cannot_improve(float(running_scores[0]), generated)
                choice = torch.cat([beam_ids[keep], words[keep], torch.tensor([int(over)], device=device)])
            choice = broadcast_from_last_stage(choice, (2 * beam + 1,), torch.long)
            if choice[-1] == NON_FINITE:
                raise NonFiniteLogitsError()
            if choice[-1]:
                break
            order = choice[:beam]
            tokens = tokens[order]
            tokens[:, context_length] = choice[beam : 2 * beam]
            kv_cache.reorder(order)
            previous = context_length
    finally:
        model.train(was_training)
    rows, scores = _share_finished(finished, beam, total_length, device)
    return BeamSearchOutput(
        tokens=rows,
        texts=[tokenizer.detokenize(row) for row in rows],
        segments=[[tokenizer.detokenize([token]) for token in row] for row in rows],
        scores=scores,
    )


def _share_finished(
    finished: _Finished, beam: int, total_length: int, device: torch.device
) -> tuple[list[list[int]], list[float]]:
    """The last stage's hypotheses on every rank: rows of tokens padded with -1, then the scores."""
    table = None
    if finished.hypotheses:  # the last stage
        table = torch.full((beam, total_length + 1), -1, dtype=torch.long, device=device)
        for row, (score, hypothesis) in enumerate(finished.hypotheses):
            table[row, : len(hypothesis)] = torch.tensor(hypothesis, device=device)
            table[row, -1] = torch.tensor(score, dtype=torch.float64).view(torch.long)  # the score's bits
    table = broadcast_from_last_stage(table, (beam, total_length + 1), torch.long)
    count = int(
        (table[:, 0] >= 0).sum()
    )  # rows holding a hypothesis (all of them, but for a tiny vocabulary)
    scores = table[:count, -1].contiguous().view(torch.float64).tolist()
    rows = [[token for token in row if token >= 0] for row in table[:count, :-1].tolist()]
    return rows, scores
