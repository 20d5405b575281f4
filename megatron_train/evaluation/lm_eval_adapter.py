"""Run EleutherAI's lm-evaluation-harness on our model: the three request types of `lm_eval.api.model.LM`.

lm-eval is optional (`pip install megatron-flow[dev]` or `pip install lm-eval`): with it installed the adapter
subclasses its `LM` and registers as model type "megatron-flow" when this module is imported, which lm-eval's
own `lm_eval` command never does; `python -m megatron_train.tasks.lm_eval` is that command with the adapter
registered. Without lm-eval the class keeps the same methods, taking any request objects whose `.args` are the
request's arguments.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from megatron_train.inference.generation import GenerationParams, generate, max_sequence_length
from megatron_train.tokenizer.base import MegatronTokenizer

try:
    from lm_eval.api.model import LM as _HarnessLM
    from lm_eval.api.registry import register_model
except ImportError:  # the harness is optional: keep the same interface without it
    _HarnessLM = object

    def register_model(*names):
        return lambda cls: cls


# `--model_args` keys and their types: the checkpoint, then Megatron's tokenizer flags, then batching.
MODEL_ARGS: dict[str, type] = {
    "load": str,
    "ckpt_step": int,
    "tokenizer_type": str,
    "vocab_file": str,
    "merge_file": str,
    "tokenizer_model": str,
    "vocab_size": int,
    "batch_size": int,
    "max_length": int,
}


@register_model("megatron-flow")
class MegatronLMEval(_HarnessLM):
    """Scores and generates with a GPTModel and its tokenizer, batching requests by `batch_size`."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: MegatronTokenizer,
        batch_size: int = 8,
        max_length: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length or max_sequence_length(model)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict | None = None
    ) -> MegatronLMEval:
        """lm-eval's constructor from `--model_args load=CKPT ...`: the keys of `MODEL_ARGS`; the tokenizer
        keys replace the tokenizer the checkpoint recorded, as the tokenizer flags of the other tools do."""
        from megatron_train.device import get_device
        from megatron_train.inference.checkpoint import load_for_inference

        unknown = sorted(set(arg_dict) - set(MODEL_ARGS))
        if unknown or "load" not in arg_dict:
            raise ValueError(
                "--model_args for megatron-flow take load=CHECKPOINT_DIR (required) and "
                + ", ".join(name for name in MODEL_ARGS if name != "load")
                + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            )
        options = {name: MODEL_ARGS[name](value) for name, value in arg_dict.items()}
        batch_size = options.pop("batch_size", 8)
        batch_size = (additional_config or {}).get("batch_size") or batch_size  # lm-eval's --batch_size wins
        max_length = options.pop("max_length", None)
        model, tokenizer, _ = load_for_inference(argparse.Namespace(**options), device=get_device())
        return cls(model, tokenizer, batch_size=int(batch_size), max_length=max_length)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MegatronLMEval:
        """lm-eval's constructor from `--model_args load=CKPT,batch_size=8`."""
        options = dict(item.split("=", 1) for item in arg_string.split(",") if item)
        return cls.create_from_arg_obj(options, additional_config)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids, split as lm-eval does: trailing spaces of the context move to the
        continuation, and the continuation's ids are those of the whole text after the context's."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.tokenizer.eod], self.tokenizer.tokenize(continuation)
        context_ids = self.tokenizer.tokenize(context)
        return context_ids, self.tokenizer.tokenize(context + continuation)[len(context_ids) :]

    @torch.inference_mode()
    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding yields the continuation) per pair;
        contexts are cut from the left to fit max_length."""
        device = next(self.model.parameters()).device
        results = []
        for first in tqdm(range(0, len(pairs), self.batch_size), desc="scoring", unit="batch", leave=False):
            batch = pairs[first : first + self.batch_size]
            sequences = [
                (context + continuation)[-(self.max_length + 1) :] for context, continuation in batch
            ]
            width = max(len(sequence) for sequence in sequences) - 1
            ids = torch.full((len(batch), width + 1), self.tokenizer.eod, dtype=torch.long)
            for row, sequence in enumerate(sequences):
                ids[row, : len(sequence)] = torch.tensor(sequence)
            ids = ids.to(device)
            position_ids = torch.arange(width, device=device).expand(len(batch), -1)
            logits = self.model(ids[:, :-1], position_ids=position_ids)[..., : self.tokenizer.vocab_size]
            log_probs = F.log_softmax(logits.float(), dim=-1).cpu()
            for row, ((_, continuation), sequence) in enumerate(zip(batch, sequences, strict=True)):
                end = len(sequence) - 1
                rows = log_probs[row, end - len(continuation) : end]
                target = torch.tensor(continuation)
                total = float(rows.gather(-1, target.unsqueeze(-1)).sum())
                results.append((total, bool((rows.argmax(-1) == target).all())))
        return results

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        """Each request's args are (context, continuation)."""
        return self.score([self._encode_pair(*request.args) for request in requests])

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        """Each request's args are (text,): its full log-likelihood, in disjoint windows of max_length tokens,
        the first conditioned on eod (lm-eval's rolling windows with context_len=1)."""
        results = []
        for request in requests:
            tokens = self.tokenizer.tokenize(request.args[0])
            pairs = [
                (
                    [self.tokenizer.eod] if start == 0 else [tokens[start - 1]],
                    tokens[start : start + self.max_length],
                )
                for start in range(0, len(tokens), self.max_length)
            ]
            results.append(sum(total for total, _ in self.score(pairs)))
        return results

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        """Each request's args are (context, gen_kwargs): greedy unless do_sample; stops at any `until` string."""
        results = []
        for request in tqdm(requests, desc="generating", unit="request", leave=False):
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or []
            max_new = min(int(gen_kwargs.get("max_gen_toks", 256)), self.max_length - 1)
            sampled = (
                bool(gen_kwargs.get("do_sample", False)) and float(gen_kwargs.get("temperature", 1.0)) > 0
            )
            context_ids = self.tokenizer.tokenize(context)[-(self.max_length - max_new) :]
            params = GenerationParams(
                tokens_to_generate=max_new,
                top_k=0 if sampled else 1,
                temperature=float(gen_kwargs.get("temperature", 1.0)) if sampled else 1.0,
                stop_strings=(until,) if isinstance(until, str) else tuple(until),
            )
            output = generate(self.model, self.tokenizer, [self.tokenizer.detokenize(context_ids)], params)
            results.append(output.completions[0])
        return results
