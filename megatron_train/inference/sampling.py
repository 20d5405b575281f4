"""Pick the next token from last-position logits: greedy, temperature, top-k and top-p (Megatron's sampling.py).

Megatron's conventions: `top_k == 1` is greedy, `top_k == 0` and `top_p == 0.0` mean "no filter". Unlike
Megatron, top-k and top-p may be combined (top-k first, then top-p), as Hugging Face does; the server enforces
Megatron's "not both" rule on its Megatron-compatible endpoint.
"""

from __future__ import annotations

import torch


def validate_sampling(top_k: int, top_p: float, temperature: float) -> None:
    """Raise ValueError with the offending value, before any work is done."""
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables top-k, 1 is greedy), got {top_k}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0.0, 1.0] (0.0 disables top-p), got {top_p}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}; use top_k=1 for greedy decoding")


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf (in place)."""
    kth_largest = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
    return logits.masked_fill_(logits < kth_largest, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (in place)."""
    sorted_logits, sorted_indices = torch.sort(logits, descending=True, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Megatron's rule: drop a token when the tokens before it already exceed top_p (the top one always stays).
    remove_sorted = (cumulative - sorted_logits.softmax(dim=-1)) > top_p
    remove = remove_sorted.scatter(-1, sorted_indices, remove_sorted)
    return logits.masked_fill_(remove, float("-inf"))


def sample(
    logits: torch.Tensor,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids [b] from logits [b, vocab]; `generator` makes sampling reproducible for a seed."""
    validate_sampling(top_k, top_p, temperature)
    if top_k == 1:
        return torch.argmax(logits, dim=-1)
    logits = logits.float() / temperature
    if top_k > 1:
        filter_top_k(logits, top_k)
    if 0.0 < top_p < 1.0:
        filter_top_p(logits, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(-1)
