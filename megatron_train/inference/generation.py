"""Autoregressive text generation with a KV cache, with the semantics of Megatron's text_generation package.

A batch of prompts of different lengths is handled as Megatron does: prompts are right-padded with eod,
decoding starts at the shortest prompt's length, and a row still inside its prompt keeps its prompt token
instead of the sample. Every row decodes the same positions, so one KV cache with one offset serves the batch.
One deliberate difference: a row stops after its own `tokens_to_generate` tokens (Megatron lets short prompts
run on to the longest prompt's budget), so a prompt gives the same tokens alone and inside a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_train.inference.forward import broadcast_from_last_stage, forward_step
from megatron_train.inference.sampling import sample, validate_sampling
from megatron_train.models.kv_cache import KVCache
from megatron_train.parallel import state
from megatron_train.tokenizer.base import MegatronTokenizer


class NonFiniteLogitsError(RuntimeError):
    """The model's logits hold NaN or +inf, or a row has no finite logit: a model-side failure (weights or
    activations that are not finite), which the server answers with a 500 and this message."""

    def __init__(self) -> None:
        super().__init__(
            "the model produced non-finite logits (NaN or inf): its weights or activations are not finite, so no "
            "token can be chosen; check the checkpoint (a damaged or diverged one), or serve it in float32 if it "
            "overflows in half precision"
        )


NON_FINITE = -1  # the token the last stage sends when it cannot sample: every rank then raises the error


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[b] True where a row of logits [b, v] can be sampled: no NaN, no +inf and at least one finite value
    (-inf marks tokens that may not be chosen: the padding rows, a top-k filter)."""
    return ~(torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1)) & torch.isfinite(logits).any(-1)


@dataclass(frozen=True)
class GenerationParams:
    """What to generate. Names follow Megatron's `generate_and_post_process` and its server's request."""

    tokens_to_generate: int = 64
    max_total_length: int | None = None  # also cap each row's prompt + generated tokens at this length
    return_output_log_probs: bool = False
    top_logprobs: int = 0  # also return the n most likely tokens and their logprobs at every position
    top_k: int = 0
    top_p: float = 0.0
    temperature: float = 1.0
    add_BOS: bool = False
    use_eod_token_for_early_termination: bool = True
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    prevent_newline_after_colon: bool = False
    stop_strings: tuple[str, ...] = ()
    stop_token: int | None = None  # the termination id; None means the tokenizer's eod
    random_seed: int = -1  # -1: draw from torch's global generator, as Megatron does
    use_kv_cache: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the bad field, before the model is touched."""
        if self.tokens_to_generate < 0:
            raise ValueError(f"tokens_to_generate must be >= 0, got {self.tokens_to_generate}")
        validate_sampling(self.top_k, self.top_p, self.temperature)
        if self.max_total_length is not None and self.max_total_length < 1:
            raise ValueError(f"max_total_length must be >= 1, got {self.max_total_length}")
        if self.random_seed < -1:
            raise ValueError(f"random_seed must be >= 0 (or -1 for unseeded), got {self.random_seed}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if any(not stop for stop in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")


@dataclass
class GenerationOutput:
    """One entry per prompt. `tokens`, `texts` and `segments` cover prompt + generation (Megatron's answer);
    `logprobs[i][j]` is log p(tokens[i][j + 1] | tokens[i][: j + 1]), so it has len(tokens[i]) - 1 entries."""

    tokens: list[list[int]]
    texts: list[str]
    segments: list[list[str]]
    logprobs: list[list[float]] | None
    top_logprobs: list[list[list[tuple[int, float]]]] | None  # [row][j]: the n best (id, logprob) at j + 1
    prompt_lengths: list[int]
    completions: list[str]  # the generated text alone, without the eod token and cut before a stop string
    finish_reasons: list[str]  # "stop" (eod, eol or a stop string) or "length"


def tokenize_prompts(
    tokenizer: MegatronTokenizer, prompts: Sequence[str], budgets: torch.Tensor, add_BOS: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids right-padded with eod to the longest prompt + its tokens to generate (`budgets` [b]) [b, s],
    and the lengths [b]."""
    bos = [tokenizer.eod] if add_BOS else []
    prompt_tokens = [bos + ids for ids in tokenizer.tokenize_batch(list(prompts))]
    for index, ids in enumerate(prompt_tokens):
        if not ids:
            raise ValueError(f"prompt {index} is empty: pass add_BOS=True to generate from an empty prompt")
    lengths = torch.tensor([len(ids) for ids in prompt_tokens], dtype=torch.long)
    tokens = torch.full((len(prompt_tokens), int((lengths + budgets).max())), tokenizer.eod)
    for row, ids in enumerate(prompt_tokens):
        tokens[row, : len(ids)] = torch.tensor(ids)
    return tokens, lengths


def max_sequence_length(model: torch.nn.Module) -> int:
    """The longest prompt + generation the model can take: its position limit."""
    config = model.config
    return config.max_position_embeddings or config.seq_length


def supports_kv_cache(model: torch.nn.Module) -> bool:
    """False for a model that reruns the whole text each step (the toy family's model of tests/helpers)."""
    return getattr(model, "supports_kv_cache", True)


def supports_beam_search(model: torch.nn.Module) -> bool:
    """False for a model without a KV cache, or whose cache holds what beams cannot reorder (a Retro model's
    encoded neighbours: `retro.retrieval.RetrievingModel`)."""
    return getattr(model, "supports_beam_search", supports_kv_cache(model))


def check_fits(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    """Refuse padded prompts + generation [b, s] longer than the model's positions (Megatron's message)."""
    limit = max_sequence_length(model)
    if tokens.size(1) > limit:
        raise ValueError(
            f"Length of prompt + tokens_to_generate longer than allowed: {tokens.size(1)} tokens > {limit} "
            "(the model's max_position_embeddings)"
        )


def allocate_kv_cache(model: torch.nn.Module, batch_size: int, max_seq_len: int) -> KVCache:
    """An empty KV cache shaped for this model's attention on this tensor- and pipeline-parallel rank, of the
    model's `kv_cache_class` (a Retro model's carries its encoded neighbours too); a model whose past is more
    than keys and values allocates its own (a hybrid model's conv and SSM states: `allocate_inference_cache`)."""
    if hasattr(model, "allocate_inference_cache"):
        return model.allocate_inference_cache(batch_size, max_seq_len)
    config = model.config
    weight = next(model.parameters())
    return getattr(model, "kv_cache_class", KVCache)(
        num_layers=config.num_layers // state.get_pipeline_model_parallel_world_size(),  # this stage's layers
        batch_size=batch_size,
        max_seq_len=max_seq_len,
        num_kv_heads=config.num_query_groups_effective // state.get_tensor_model_parallel_world_size(),
        head_dim=config.kv_channels,
        dtype=weight.dtype,
        device=weight.device,
    )


def vocab_logits(model, tokens, position_ids, kv_cache, vocab_size: int) -> torch.Tensor | None:
    """fp32 logits over the tokenizer's real vocabulary (the model's is padded); None off the last stage."""
    logits = forward_step(model, tokens, position_ids, kv_cache)
    return None if logits is None else logits[..., :vocab_size].float()


def _first_token(tokenizer: MegatronTokenizer, text: str) -> int | None:
    ids = tokenizer.tokenize(text)
    return ids[0] if ids else None


def _single_token(tokenizer: MegatronTokenizer, text: str) -> int:
    """The id of `text` when the tokenizer makes it one token (GPT-2: "\\n" -> 198, "\\n\\n" -> 628), else -1."""
    ids = tokenizer.tokenize(text)
    return ids[0] if len(ids) == 1 else -1


class _StopRules:
    """Which rows a new token ends: the termination id, Megatron's eol rules, and stop strings."""

    def __init__(self, tokenizer: MegatronTokenizer, params: GenerationParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.termination_id = tokenizer.eod if params.stop_token is None else params.stop_token
        if params.stop_on_eol or params.stop_on_double_eol:  # -1 where not a single token: never matches
            self.eol, self.double_eol = _single_token(tokenizer, "\n"), _single_token(tokenizer, "\n\n")

    def hits(
        self, tokens: torch.Tensor, lengths: torch.Tensor, context_length: int, candidates: torch.Tensor
    ) -> torch.Tensor:
        """Rows among `candidates` [b] whose token at `context_length` ends their generation."""
        new, previous = tokens[:, context_length], tokens[:, context_length - 1]
        hit = torch.zeros_like(candidates)
        if self.params.use_eod_token_for_early_termination:
            hit |= new == self.termination_id
        if self.params.stop_on_eol or self.params.stop_on_double_eol:
            hit |= new == self.double_eol
            if self.params.stop_on_double_eol:
                hit |= (new == self.eol) & (previous == self.eol)
            else:
                hit |= new == self.eol
        hit &= candidates
        if self.params.stop_strings:
            for row in (candidates & ~hit).nonzero().flatten().tolist():
                generated = self.tokenizer.detokenize(tokens[row, lengths[row] : context_length + 1].tolist())
                hit[row] = any(stop in generated for stop in self.params.stop_strings)
        return hit


class TokenScores:
    """Log-probabilities of the tokens in a buffer [b, s]: of each token given the ones before it [b, s - 1],
    and optionally the `top_n` most likely tokens at each position (values and ids [b, s - 1, n]). Filled on the
    last pipeline stage, then broadcast to every rank (`share`)."""

    def __init__(self, batch_size: int, length: int, top_n: int, device: torch.device) -> None:
        self.logprobs = torch.zeros(batch_size, length - 1, device=device)
        self.top_n = top_n
        self.top_values = torch.zeros(batch_size, length - 1, top_n, device=device)
        self.top_ids = torch.zeros(batch_size, length - 1, top_n, dtype=torch.long, device=device)

    def record(self, logits: torch.Tensor, tokens: torch.Tensor, start: int) -> None:
        """`logits` [b, n, v] at positions start .. start + n - 1 score tokens[:, start + 1 : start + n + 1]."""
        end = start + logits.size(1)
        log_probs = F.log_softmax(logits, dim=-1)
        self.logprobs[:, start:end] = log_probs.gather(
            -1, tokens[:, start + 1 : end + 1].unsqueeze(-1)
        ).squeeze(-1)
        if self.top_n:
            top = log_probs.topk(min(self.top_n, log_probs.size(-1)), dim=-1)
            self.top_values[:, start:end], self.top_ids[:, start:end] = top.values, top.indices

    def share(self) -> None:
        """The last stage's scores on every rank; a score that is not finite (the model's logits were not) is
        NonFiniteLogitsError on every rank."""
        for tensor in (self.logprobs, self.top_values, self.top_ids):
            broadcast_from_last_stage(tensor, tensor.shape, tensor.dtype)
        if not bool(torch.isfinite(self.logprobs).all()):
            raise NonFiniteLogitsError()

    def rows(
        self, lengths: Sequence[int]
    ) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]] | None]:
        """Per row of final length n: its n - 1 logprobs, and its top-n lists (None without top_n)."""
        logprobs = [row[: n - 1] for row, n in zip(self.logprobs.tolist(), lengths, strict=True)]
        if not self.top_n:
            return logprobs, None
        top = [
            [
                list(zip(ids, values, strict=True))
                for ids, values in zip(row_ids[: n - 1], row_values[: n - 1], strict=True)
            ]
            for row_ids, row_values, n in zip(
                self.top_ids.tolist(), self.top_values.tolist(), lengths, strict=True
            )
        ]
        return logprobs, top


def generate_tokens(
    model: torch.nn.Module,
    tokenizer: MegatronTokenizer,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    params: GenerationParams,
    budgets: torch.Tensor,
    scores: TokenScores | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode into the padded `tokens` [b, s] (Megatron's generate_tokens_probs_and_return_on_first_stage),
    at most `budgets` [b] new tokens per row, filling `scores` when given.

    Returns tokens, each row's final length (prompt + generated), and which rows ended on a stop rule (the
    others ran out of tokens_to_generate)."""
    check_fits(model, tokens)
    batch_size, total_length = tokens.shape
    vocab_size = tokenizer.vocab_size
    stop_rules = _StopRules(tokenizer, params)
    colon = newline = None
    if params.prevent_newline_after_colon:
        colon, newline = _first_token(tokenizer, ":"), _first_token(tokenizer, "\n")
    generator = None
    if params.random_seed >= 0:
        generator = torch.Generator(device=tokens.device).manual_seed(params.random_seed)

    row_limits = (lengths + budgets).clamp(max=total_length)
    final_lengths = row_limits.clone()
    done = torch.zeros(batch_size, dtype=torch.bool, device=tokens.device)
    stopped = torch.zeros_like(done)
    use_kv_cache = params.use_kv_cache and supports_kv_cache(model)
    kv_cache = allocate_kv_cache(model, batch_size, total_length) if use_kv_cache else None
    position_ids = torch.arange(total_length, device=tokens.device).expand(batch_size, -1)

    previous = 0
    for context_length in range(int(lengths.min()), total_length):
        # With a cache only the new positions go through the model; without, the whole prefix again.
        start = previous if kv_cache is not None else 0
        logits = vocab_logits(
            model,
            tokens[:, start:context_length],
            position_ids[:, start:context_length],
            kv_cache,
            vocab_size,
        )
        new_tokens = None
        if logits is not None:  # the last pipeline stage samples; the others receive its tokens
            logits = logits[:, previous - start :]
            last_logits = logits[:, -1]
            if colon is not None and newline is not None:
                last_logits = last_logits.clone()
                last_logits[tokens[:, context_length - 1] == colon, newline] = float("-inf")
            if bool(finite_rows(last_logits).all()):
                new_tokens = sample(last_logits, params.top_k, params.top_p, params.temperature, generator)
            else:
                new_tokens = torch.full((batch_size,), NON_FINITE, dtype=tokens.dtype, device=tokens.device)
        new_tokens = broadcast_from_last_stage(new_tokens, (batch_size,), tokens.dtype)
        if bool((new_tokens == NON_FINITE).any()):
            raise NonFiniteLogitsError()

        started = lengths <= context_length
        tokens[:, context_length] = torch.where(started, new_tokens, tokens[:, context_length])
        if scores is not None and logits is not None:
            scores.record(logits, tokens, previous)

        active = started & ~done
        hit = stop_rules.hits(tokens, lengths, context_length, active)
        finished = hit | (active & (context_length + 1 >= row_limits))
        final_lengths[finished] = context_length + 1
        stopped |= hit
        done |= finished
        previous = context_length
        if bool(done.all()):
            break
    if scores is not None:
        scores.share()
    return tokens, final_lengths, stopped


def score_tokens(
    model: torch.nn.Module, tokenizer: MegatronTokenizer, tokens: torch.Tensor, scores: TokenScores
) -> None:
    """Fill `scores` with the log-probability of each token given the ones before it (Megatron's score path)."""
    check_fits(model, tokens)
    position_ids = torch.arange(tokens.size(1), device=tokens.device).expand_as(tokens)
    logits = vocab_logits(model, tokens, position_ids, None, tokenizer.vocab_size)
    if logits is not None:
        scores.record(logits[:, :-1], tokens, 0)
    scores.share()


def _completion(
    tokenizer: MegatronTokenizer, ids: list[int], termination_id: int, stops: Sequence[str]
) -> str:
    """The generated text as an API returns it: no trailing eod, cut before the first stop string."""
    if ids and ids[-1] == termination_id:
        ids = ids[:-1]
    text = tokenizer.detokenize(ids)
    cut = min((text.find(stop) for stop in stops if stop in text), default=len(text))
    return text[:cut]


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    tokenizer: MegatronTokenizer,
    prompts: Sequence[str],
    params: GenerationParams = GenerationParams(),
    tokens_per_prompt: Sequence[int] | None = None,
) -> GenerationOutput:
    """Generate continuations of `prompts` (Megatron's generate_and_post_process), on the model's device.

    `tokens_per_prompt` gives each prompt its own number of tokens to generate, from 1 to
    `params.tokens_to_generate` (the server's batches of requests); by default every prompt gets that many.
    `tokens_to_generate=0` scores the prompts instead (one forward, logprobs only)."""
    params.validate()
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    if tokens_per_prompt is None:
        tokens_per_prompt = [params.tokens_to_generate] * len(prompts)
    elif len(tokens_per_prompt) != len(prompts) or not all(
        0 < n <= params.tokens_to_generate for n in tokens_per_prompt
    ):
        raise ValueError(
            f"tokens_per_prompt needs one count from 1 to tokens_to_generate={params.tokens_to_generate} per "
            f"prompt; got {list(tokens_per_prompt)} for {len(prompts)} prompts"
        )
    budgets = torch.tensor(tokens_per_prompt, dtype=torch.long)
    device = next(model.parameters()).device
    tokens, lengths = tokenize_prompts(tokenizer, prompts, budgets, params.add_BOS)
    if params.max_total_length is not None:
        longest = int(lengths.max())
        if longest >= params.max_total_length and params.tokens_to_generate > 0:
            raise ValueError(
                f"prompt {int(lengths.argmax())} has {longest} tokens, no room to generate within "
                f"max_total_length={params.max_total_length}"
            )
        tokens = tokens[:, : max(params.max_total_length, longest)]
    tokens, lengths = tokens.to(device), lengths.to(device)
    was_training = model.training
    model.eval()
    try:
        scores = None
        if params.return_output_log_probs or params.top_logprobs:
            scores = TokenScores(tokens.size(0), tokens.size(1), params.top_logprobs, tokens.device)
        if params.tokens_to_generate == 0:
            final_lengths, stopped = lengths, torch.zeros_like(lengths, dtype=torch.bool)
            if scores is not None:
                score_tokens(model, tokenizer, tokens, scores)
        else:
            tokens, final_lengths, stopped = generate_tokens(
                model, tokenizer, tokens, lengths, params, budgets.to(device), scores
            )
    finally:
        model.train(was_training)

    termination_id = tokenizer.eod if params.stop_token is None else params.stop_token
    rows = [row[:length] for row, length in zip(tokens.tolist(), final_lengths.tolist(), strict=True)]
    prompt_lengths = lengths.tolist()
    logprobs, top_logprobs = scores.rows(final_lengths.tolist()) if scores is not None else (None, None)
    return GenerationOutput(
        tokens=rows,
        texts=[tokenizer.detokenize(row) for row in rows],
        segments=[[tokenizer.detokenize([token]) for token in row] for row in rows],
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_lengths=prompt_lengths,
        completions=[
            _completion(tokenizer, row[start:], termination_id, params.stop_strings)
            for row, start in zip(rows, prompt_lengths, strict=True)
        ],
        finish_reasons=["stop" if hit else "length" for hit in stopped.tolist()],
    )
