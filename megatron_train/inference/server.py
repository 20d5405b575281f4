"""The text generation server: Megatron's `PUT /api` and an OpenAI-style `POST /v1/completions` (FastAPI).

Every request is validated before the model is touched; a bad one answers 400 with a message that says what
is wrong (Megatron's own wording on /api) and the server keeps serving. One lock serialises generation, so
concurrent requests are safe; the event loop stays free while a request generates (it runs in a thread).
"""

from __future__ import annotations

import json
import logging
import reprlib
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from megatron_train.inference.generation import GenerationOutput, GenerationParams, generate
from megatron_train.tokenizer.base import MegatronTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for (server flags)."""

    max_batch_size: int = 128  # Megatron's server: "Maximum number of prompts is 128"
    max_tokens_to_generate: int = 1024
    max_tokens_to_oom: int = 12000  # Megatron's --max-tokens-to-oom: prompts x (longest + generated)
    max_request_bytes: int = 1 << 20


MIN_TEMPERATURE = 1e-4  # below this, logits / temperature overflows float32 to inf and sampling fails
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
# Values quoted back in messages and logs are cut to a few dozen characters and levels of nesting.
_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxstring, _PREVIEW.maxother, _PREVIEW.maxlong = 3, 60, 60, 40


class RequestError(ValueError):
    """A request the server refuses: answered with 400 and this message."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_unicode(text: str) -> bool:
    """False for strings JSON can carry but UTF-8 cannot (a lone surrogate such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and _is_unicode(value)


def _field(body: dict, name: str, default: Any, valid: Callable[[Any], bool], message: str) -> Any:
    """body[name] if present and valid, the default if absent; otherwise a RequestError with `message`."""
    if name not in body:
        return default
    if not valid(body[name]):
        raise RequestError(f"{message} (got {_PREVIEW.repr(body[name])})")
    return body[name]


def _check_prompts(prompts: Any, name: str, limits: ServerLimits) -> list[str]:
    if not isinstance(prompts, list) or not all(isinstance(prompt, str) for prompt in prompts):
        raise RequestError(f"{name} is not a list of strings")
    if not prompts:
        raise RequestError(f"{name} is empty")
    if len(prompts) > limits.max_batch_size:
        raise RequestError(f"Maximum number of prompts is {limits.max_batch_size}")
    for index, prompt in enumerate(prompts):
        if not _is_unicode(prompt):
            raise RequestError(f"{name}[{index}] is not valid Unicode: it holds a lone surrogate")
    return prompts


def parse_megatron_request(
    body: dict, limits: ServerLimits, vocab_size: int
) -> tuple[list[str], GenerationParams, bool]:
    """Megatron's PUT /api request -> (prompts, params, no_log), with Megatron's checks and error strings;
    `vocab_size` (the tokenizer's) bounds stop_token."""
    if "prompts" not in body:
        raise RequestError("prompts argument required")
    if "max_len" in body:
        raise RequestError("max_len is no longer used.  Replace with tokens_to_generate")
    if "sentences" in body:
        raise RequestError("sentences is no longer used.  Replace with prompts")
    for unsupported in ("beam_width", "length_penalty", "top_p_decay", "top_p_bound"):
        if unsupported in body:
            raise RequestError(f"{unsupported} is not supported by this server")
    prompts = _check_prompts(body["prompts"], "prompts", limits)
    tokens_to_generate = _field(
        body,
        "tokens_to_generate",
        64,
        lambda v: _is_int(v) and 0 <= v <= limits.max_tokens_to_generate,
        f"tokens_to_generate must be an integer between 0 and {limits.max_tokens_to_generate}",
    )
    logprobs = _field(body, "logprobs", False, _is_bool, "logprobs must be a boolean value")
    if tokens_to_generate == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True")
    temperature = _field(
        body,
        "temperature",
        1.0,
        lambda v: _is_number(v) and MIN_TEMPERATURE <= v <= 100.0,
        f"temperature must be a positive number less than or equal to 100.0 and at least {MIN_TEMPERATURE}",
    )
    top_k = _field(
        body,
        "top_k",
        0,
        lambda v: _is_int(v) and 0 <= v <= 1000,
        "top_k must be an integer equal to or greater than 0 and less than or equal to 1000",
    )
    top_p = _field(
        body,
        "top_p",
        0.0,
        lambda v: _is_number(v) and 0.0 <= v <= 1.0,
        "top_p must be a float between 0 and 1.0",
    )
    if top_p > 0.0 and top_k > 0:
        raise RequestError("cannot set both top-k and top-p samplings.")
    flags = {
        name: _field(body, name, False, _is_bool, f"{name} must be a boolean value")
        for name in ("add_BOS", "stop_on_eol", "stop_on_double_eol", "prevent_newline_after_colon", "no_log")
    }
    if any(not prompt for prompt in prompts) and not flags["add_BOS"]:
        raise RequestError("Empty prompts require add_BOS=true")
    random_seed = _field(
        body,
        "random_seed",
        -1,
        lambda v: _is_int(v) and 0 <= v <= MAX_SEED,
        "random_seed must be a non-negative integer below 2**63",
    )
    stop_token = _field(
        body,
        "stop_token",
        None,
        lambda v: _is_int(v) and 0 <= v < vocab_size,
        f"stop_token must be an integer token id from 0 to {vocab_size - 1}",
    )
    stop_strings = _field(
        body,
        "stop_strings",
        [],
        lambda v: isinstance(v, list) and all(_is_text(s) for s in v),
        "stop_strings must be a list of non-empty strings of valid Unicode",
    )
    params = GenerationParams(
        tokens_to_generate=tokens_to_generate,
        return_output_log_probs=logprobs,
        top_k=top_k,
        top_p=float(top_p),
        temperature=float(temperature),
        add_BOS=flags["add_BOS"],
        stop_on_eol=flags["stop_on_eol"],
        stop_on_double_eol=flags["stop_on_double_eol"],
        prevent_newline_after_colon=flags["prevent_newline_after_colon"],
        stop_strings=tuple(stop_strings),
        stop_token=stop_token,
        random_seed=random_seed,
    )
    return prompts, params, flags["no_log"]


def parse_completion_request(body: dict, limits: ServerLimits) -> tuple[list[str], GenerationParams, bool]:
    """OpenAI's completion request -> (prompts, params, echo). temperature 0 is greedy, as OpenAI's is."""
    if "prompt" not in body:
        raise RequestError("prompt is required: a string or a list of strings")
    prompt = body["prompt"]
    prompts = _check_prompts([prompt] if isinstance(prompt, str) else prompt, "prompt", limits)
    if any(not text for text in prompts):
        raise RequestError("prompt must not be empty")
    _field(body, "n", 1, lambda v: v == 1 and _is_int(v), "n must be 1: one completion per prompt")
    _field(body, "stream", False, lambda v: v is False, "stream is not supported: set stream to false")
    max_tokens = _field(
        body,
        "max_tokens",
        16,
        lambda v: _is_int(v) and 0 <= v <= limits.max_tokens_to_generate,
        f"max_tokens must be an integer between 0 and {limits.max_tokens_to_generate}",
    )
    temperature = _field(
        body,
        "temperature",
        1.0,
        lambda v: _is_number(v) and (v == 0.0 or MIN_TEMPERATURE <= v <= 2.0),
        f"temperature must be between 0 and 2 (0 is greedy; a positive one is at least {MIN_TEMPERATURE})",
    )
    top_p = _field(body, "top_p", 1.0, lambda v: _is_number(v) and 0.0 < v <= 1.0, "top_p must be in (0, 1]")
    top_k = _field(body, "top_k", 0, lambda v: _is_int(v) and v >= 0, "top_k must be a non-negative integer")
    logprobs = _field(
        body, "logprobs", None, lambda v: v is None or (_is_int(v) and 0 <= v <= 5), "logprobs must be 0 to 5"
    )
    echo = _field(body, "echo", False, _is_bool, "echo must be a boolean value")
    seed = _field(
        body,
        "seed",
        None,
        lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_SEED),
        "seed must be an integer >= 0 and below 2**63",
    )
    stop = _field(
        body,
        "stop",
        None,
        lambda v: (
            v is None or _is_text(v) or (isinstance(v, list) and len(v) <= 4 and all(_is_text(s) for s in v))
        ),
        "stop must be a non-empty string or a list of up to 4 non-empty strings (valid Unicode)",
    )
    if max_tokens == 0 and not echo:
        raise RequestError("max_tokens=0 needs echo=true (it scores the prompt)")
    greedy = temperature == 0.0
    params = GenerationParams(
        tokens_to_generate=max_tokens,
        return_output_log_probs=logprobs is not None,
        top_k=1 if greedy else top_k,
        top_p=0.0 if greedy or top_p == 1.0 else float(top_p),
        temperature=1.0 if greedy else float(temperature),
        stop_strings=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        random_seed=-1 if seed is None else seed,
    )
    return prompts, params, echo


def request_summary(prompts: list[str], params: GenerationParams) -> str:
    """A log line of bounded length, whatever the request's size: counts, the start of the first prompt and
    the sampling settings."""
    return (
        f"{len(prompts)} prompt(s) of {sum(len(prompt) for prompt in prompts)} characters, the first "
        f"{_PREVIEW.repr(prompts[0])}; tokens_to_generate={params.tokens_to_generate} "
        f"temperature={params.temperature} top_k={params.top_k} top_p={params.top_p}"
    )


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


def completion_choices(output: GenerationOutput, prompts: list[str], echo: bool) -> list[dict]:
    """OpenAI's `choices`: the completion (after the prompt when echo), its finish reason and logprobs."""
    choices = []
    for index, prompt in enumerate(prompts):
        start = 0 if echo else output.prompt_lengths[index]
        logprobs = None
        if output.logprobs is not None:
            segments = output.segments[index][start:]
            token_logprobs = ([None] if start == 0 else []) + output.logprobs[index][max(start - 1, 0) :]
            offsets, offset = [], 0
            for segment in segments:
                offsets.append(offset)
                offset += len(segment)
            logprobs = {
                "tokens": segments,
                "token_logprobs": token_logprobs[: len(segments)],
                "top_logprobs": None,
                "text_offset": offsets,
            }
        choices.append(
            {
                "index": index,
                "text": (prompt if echo else "") + output.completions[index],
                "logprobs": logprobs,
                "finish_reason": output.finish_reasons[index],
            }
        )
    return choices


class GenerationService:
    """The model behind one lock, with the request budget checks that need the tokenizer."""

    def __init__(self, model: torch.nn.Module, tokenizer: MegatronTokenizer, limits: ServerLimits) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.limits = limits
        self.lock = threading.Lock()

    def check_budget(self, prompts: list[str], params: GenerationParams) -> None:
        """Megatron's "Too many tokens" guard: batch x (longest prompt + generated) <= max_tokens_to_oom."""
        longest = max(len(ids) for ids in self.tokenizer.tokenize_batch(prompts)) + int(params.add_BOS)
        total = len(prompts) * (longest + params.tokens_to_generate)
        if total > self.limits.max_tokens_to_oom:
            raise RequestError(f"Too many tokens.  {total} is greater than {self.limits.max_tokens_to_oom}")

    def generate(self, prompts: list[str], params: GenerationParams) -> GenerationOutput:
        self.check_budget(prompts, params)
        with self.lock:
            started = time.perf_counter()
            output = generate(self.model, self.tokenizer, prompts, params)
            elapsed = time.perf_counter() - started
        generated = sum(len(ids) - n for ids, n in zip(output.tokens, output.prompt_lengths, strict=True))
        logger.info("generated %d tokens in %.2f s (%.1f tokens/s)", generated, elapsed, generated / elapsed)
        return output


async def read_json_body(request: Request, limit: int) -> dict:
    """The request's JSON object, refusing bodies over `limit` bytes without reading them whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body is {declared} bytes; the limit is {limit} (--max-request-bytes)")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(f"request body is over {limit} bytes (--max-request-bytes)")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError("request body is nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    return data


def create_app(
    model: torch.nn.Module,
    tokenizer: MegatronTokenizer,
    limits: ServerLimits = ServerLimits(),
    model_name: str = "megatron-flow",
) -> FastAPI:
    """The FastAPI app serving `model`; run it with uvicorn (see tools/run_text_generation_server.py)."""
    service = GenerationService(model, tokenizer, limits)
    app = FastAPI(title="Megatron-Flow text generation")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": model_name}

    @app.put("/api")
    async def megatron_generate(request: Request):
        try:
            body = await read_json_body(request, limits.max_request_bytes)
            prompts, params, no_log = parse_megatron_request(body, limits, tokenizer.vocab_size)
            if not no_log:
                logger.info("request from %s: %s", _client(request), request_summary(prompts, params))
            output = await run_in_threadpool(service.generate, prompts, params)
        except ValueError as error:
            return JSONResponse({"message": str(error)}, status_code=400)
        return {
            "text": output.texts,
            "segments": output.segments,
            "logprobs": output.logprobs,
            "tokens": output.tokens,
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await read_json_body(request, limits.max_request_bytes)
            prompts, params, echo = parse_completion_request(body, limits)
            logger.info("completion request from %s: %s", _client(request), request_summary(prompts, params))
            output = await run_in_threadpool(service.generate, prompts, params)
        except ValueError as error:
            error_body = {"message": str(error), "type": "invalid_request_error", "param": None, "code": None}
            return JSONResponse({"error": error_body}, status_code=400)
        prompt_tokens = sum(output.prompt_lengths)
        total_tokens = sum(len(ids) for ids in output.tokens)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": completion_choices(output, prompts, echo),
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": total_tokens - prompt_tokens,
                "total_tokens": total_tokens,
            },
        }

    return app
