"""Zero-shot evaluation: WikiText perplexity, LAMBADA accuracy, dataset perplexity, lm-eval-harness adapter."""

from megatron_train.evaluation.lambada import LambadaResult, evaluate_lambada
from megatron_train.evaluation.perplexity import PerplexityResult, sum_lm_loss, validation_perplexity
from megatron_train.evaluation.wikitext import WikitextResult, evaluate_wikitext, wikitext_detokenizer

__all__ = [
    "LambadaResult",
    "PerplexityResult",
    "WikitextResult",
    "evaluate_lambada",
    "evaluate_wikitext",
    "sum_lm_loss",
    "validation_perplexity",
    "wikitext_detokenizer",
]
