"""WikiText-103 perplexity as Megatron's tasks/zeroshot_gpt reports it (avg loss, ppl, adjusted ppl, ratio).

The raw `wiki.test.tokens` file is word-tokenized ("@-@", " , "); it is detokenized first (Megatron's
wikitext detokenizer) so the model sees natural text. Perplexity is then "adjusted" to the original words:
exp(total loss / (original words - 1)), i.e. the token-level loss times (tokens - 1) / (words - 1).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from megatron_train.evaluation.perplexity import sum_lm_loss
from megatron_train.tokenizer.base import MegatronTokenizer


def wikitext_detokenizer(text: str) -> str:
    """Undo WikiText's word tokenization (Megatron's tasks/zeroshot_gpt/detokenizer.py, rule for rule)."""
    # contractions
    text = text.replace("s '", "s'")
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)
    # number separators
    text = text.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
    # punctuation
    for mark in (":", ";", ".", "!", "?", ","):
        text = text.replace(f" {mark} ", f"{mark} ")
    # brackets and quotes
    text = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", text)
    text = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", text)
    text = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", text)
    text = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', text)
    text = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", text)
    # miscellaneous
    text = text.replace("= = = =", "====").replace("= = =", "===").replace("= =", "==")
    text = text.replace(" " + chr(176) + " ", chr(176))
    text = text.replace(" \n", "\n").replace("\n ", "\n")
    text = text.replace(" N ", " 1 ")
    return text.replace(" 's", "'s")


def load_wikitext(path: str, tokenizer: MegatronTokenizer) -> tuple[list[int], int]:
    """Token ids of the detokenized file and its number of original (space-separated) words."""
    with open(path, "rb") as handle:
        raw = handle.read().decode("utf-8")
    num_original_tokens = len(raw.strip().split(" "))
    tokens = tokenizer.tokenize(wikitext_detokenizer(raw))
    if len(tokens) < 2 or num_original_tokens < 2:
        raise ValueError(
            f"{path}: {len(tokens)} tokens after tokenization; WikiText evaluation needs at least 2"
        )
    return tokens, num_original_tokens


@dataclass
class WikitextResult:
    avg_loss: float
    ppl: float
    adjusted_ppl: float
    token_ratio: float
    num_original_tokens: int
    num_tokenized_tokens: int

    def megatron_line(self, task: str = "WIKITEXT103") -> str:
        """The line Megatron prints, which users' scripts parse."""
        return (
            f" validation results on {task} | avg loss: {self.avg_loss:.4E} | ppl: {self.ppl:.4E} | "
            f"adjusted ppl: {self.adjusted_ppl:.4E} | token ratio: {self.token_ratio} |"
        )


def evaluate_wikitext(
    model: torch.nn.Module,
    tokenizer: MegatronTokenizer,
    path: str,
    seq_length: int,
    overlapping_eval: int | None = None,
    micro_batch_size: int = 8,
) -> WikitextResult:
    """Megatron's WIKITEXT103 task on `path` (the standard wiki.test.tokens format)."""
    tokens, num_original_tokens = load_wikitext(path, tokenizer)
    total_loss, _ = sum_lm_loss(model, tokens, seq_length, overlapping_eval, micro_batch_size, tokenizer.eod)
    num_tokenized_tokens = len(tokens)
    avg_loss = total_loss / (num_tokenized_tokens - 1)
    token_ratio = (num_tokenized_tokens - 1) / (num_original_tokens - 1)
    return WikitextResult(
        avg_loss=avg_loss,
        ppl=math.exp(min(20.0, avg_loss)),  # Megatron clamps the exponent at 20
        adjusted_ppl=math.exp(min(20.0, avg_loss * token_ratio)),
        token_ratio=token_ratio,
        num_original_tokens=num_original_tokens,
        num_tokenized_tokens=num_tokenized_tokens,
    )
