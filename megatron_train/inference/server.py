"""The text generation server: Megatron's `PUT /api` (with beam search), OpenAI-style `POST /v1/completions`
and `POST /v1/chat/completions` (FastAPI).

Every request is validated alone before the model is touched (its fields, Megatron's token budget, the
model's positions); a bad one answers 400 with a message that says what is wrong (Megatron's own wording on
/api) and the server keeps serving. Valid requests go to the `Batcher`: requests that arrive together run as
one batch on the model's thread (rank 0's `ModelRunner` in a multi-rank server), and the event loop stays
free meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import reprlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from megatron_train.inference.batcher import Batcher, BatchLimits
from megatron_train.inference.beam_search import BeamSearchOutput, BeamSearchParams
from megatron_train.inference.generation import (
    GenerationOutput,
    GenerationParams,
    NonFiniteLogitsError,
    max_sequence_length,
    supports_beam_search,
)
from megatron_train.inference.ranks import ModelRunner, Work
from megatron_train.tokenizer.base import MegatronTokenizer
from megatron_train.tokenizer.chat import PromptFormat, serving_chat_format

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for (server flags)."""

    max_batch_size: int = 128  # Megatron's server: "Maximum number of prompts is 128"
    max_tokens_to_generate: int = 1024
    max_tokens_to_oom: int = 12000  # Megatron's --max-tokens-to-oom: prompts x (longest + generated)
    max_request_bytes: int = 1 << 20
    max_top_logprobs: int = 20  # OpenAI's chat API allows 0 to 20 (5 on the legacy completions API)


MIN_TEMPERATURE = 1e-4  # below this, logits / temperature overflows float32 to inf and sampling fails
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
# Values quoted back in messages and logs are cut to a few dozen characters and levels of nesting.
_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxstring, _PREVIEW.maxother, _PREVIEW.maxlong = 3, 60, 60, 40


class RequestError(ValueError):
    """A request the server refuses: answered with 400 and this message."""


class ClientGone(Exception):
    """The client disconnected before its request body was complete: logged in one line, nothing answered."""


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
) -> tuple[list[str], GenerationParams | BeamSearchParams, bool]:
    """Megatron's PUT /api request -> (prompts, params, no_log), with Megatron's checks and error strings;
    `vocab_size` (the tokenizer's) bounds stop_token. With `beam_width` the params are a beam search's."""
    if "prompts" not in body:
        raise RequestError("prompts argument required")
    if "max_len" in body:
        raise RequestError("max_len is no longer used.  Replace with tokens_to_generate")
    if "sentences" in body:
        raise RequestError("sentences is no longer used.  Replace with prompts")
    for unsupported in ("top_p_decay", "top_p_bound"):
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
    if "beam_width" in body:
        return prompts, _beam_search_params(body, prompts, params), flags["no_log"]
    return prompts, params, flags["no_log"]


def _beam_search_params(body: dict, prompts: list[str], params: GenerationParams) -> BeamSearchParams:
    """Megatron's beam search fields: `beam_width` (one prompt only), `length_penalty`, `stop_token`."""
    beam_width = _field(
        body, "beam_width", None, lambda v: _is_int(v) and v >= 1, "beam_width must be an integer >= 1"
    )
    if len(prompts) > 1:
        raise RequestError("When doing beam_search, batch size must be 1")
    length_penalty = _field(body, "length_penalty", 1.0, _is_number, "length_penalty must be a float")
    if params.tokens_to_generate == 0:
        raise RequestError("beam search needs tokens_to_generate >= 1")
    return BeamSearchParams(
        beam_width=beam_width,
        tokens_to_generate=params.tokens_to_generate,
        length_penalty=float(length_penalty),
        stop_token=params.stop_token,
        add_BOS=params.add_BOS,
    )


def _openai_sampling(body: dict, limits: ServerLimits) -> dict[str, Any]:
    """The fields OpenAI's completion and chat requests share -> GenerationParams fields. temperature 0 is
    greedy, as OpenAI's is."""
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
    greedy = temperature == 0.0
    return dict(
        tokens_to_generate=max_tokens,
        top_k=1 if greedy else top_k,
        top_p=0.0 if greedy or top_p == 1.0 else float(top_p),
        temperature=1.0 if greedy else float(temperature),
        stop_strings=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        random_seed=-1 if seed is None else seed,
    )


def parse_completion_request(body: dict, limits: ServerLimits) -> tuple[list[str], GenerationParams, bool]:
    """OpenAI's (legacy) completion request -> (prompts, params, echo); `logprobs: n` also asks for the n most
    likely tokens at each position (`top_logprobs`)."""
    if "prompt" not in body:
        raise RequestError("prompt is required: a string or a list of strings")
    prompt = body["prompt"]
    prompts = _check_prompts([prompt] if isinstance(prompt, str) else prompt, "prompt", limits)
    if any(not text for text in prompts):
        raise RequestError("prompt must not be empty")
    sampling = _openai_sampling(body, limits)
    logprobs = _field(
        body, "logprobs", None, lambda v: v is None or (_is_int(v) and 0 <= v <= 5), "logprobs must be 0 to 5"
    )
    echo = _field(body, "echo", False, _is_bool, "echo must be a boolean value")
    if sampling["tokens_to_generate"] == 0 and not echo:
        raise RequestError("max_tokens=0 needs echo=true (it scores the prompt)")
    params = GenerationParams(
        **sampling, return_output_log_probs=logprobs is not None, top_logprobs=logprobs or 0
    )
    return prompts, params, echo


def parse_chat_request(
    body: dict,
    limits: ServerLimits,
    tokenizer: MegatronTokenizer,
    sft_prompt_format: PromptFormat | None = None,
) -> tuple[str, GenerationParams]:
    """OpenAI's chat completion request -> (the prompt the chat format makes of the messages: SFT's when the
    model was trained with --sft, else the tokenizer's template; see `tokenizer.chat.serving_chat_format`,
    params). `logprobs: true` returns each token's logprob, `top_logprobs: n` the n most likely tokens too."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages is required: a non-empty list of {role, content} objects")
    for index, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
            and _is_unicode(message["content"])
        ):
            raise RequestError(
                f"messages[{index}] must be an object with a string role and a string content (valid Unicode)"
            )
    sampling = _openai_sampling(body, limits)
    if sampling["tokens_to_generate"] == 0:
        raise RequestError("max_tokens must be at least 1 for a chat completion")
    logprobs = _field(body, "logprobs", False, _is_bool, "logprobs must be a boolean value")
    top_logprobs = _field(
        body,
        "top_logprobs",
        0,
        lambda v: _is_int(v) and 0 <= v <= limits.max_top_logprobs,
        f"top_logprobs must be an integer from 0 to {limits.max_top_logprobs}",
    )
    if top_logprobs and not logprobs:
        raise RequestError("top_logprobs needs logprobs=true")
    try:
        prompt = serving_chat_format(tokenizer, sft_prompt_format).prompt(
            [{"role": m["role"], "content": m["content"]} for m in messages]
        )
    except ValueError as error:
        raise RequestError(str(error)) from None
    params = GenerationParams(**sampling, return_output_log_probs=logprobs, top_logprobs=top_logprobs)
    return prompt, params


def request_summary(prompts: list[str], params: GenerationParams | BeamSearchParams) -> str:
    """A log line of bounded length, whatever the request's size: counts, the start of the first prompt and
    the sampling settings."""
    if isinstance(params, BeamSearchParams):
        settings = f"beam_width={params.beam_width} length_penalty={params.length_penalty}"
    else:
        settings = f"temperature={params.temperature} top_k={params.top_k} top_p={params.top_p}"
    return (
        f"{len(prompts)} prompt(s) of {sum(len(prompt) for prompt in prompts)} characters, the first "
        f"{_PREVIEW.repr(prompts[0])}; tokens_to_generate={params.tokens_to_generate} {settings}"
    )


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


def _top_dict(tokenizer: MegatronTokenizer, row: list[tuple[int, float]] | None) -> dict[str, float] | None:
    """OpenAI's legacy `top_logprobs` entry: token text -> logprob (None at the first prompt token)."""
    return None if row is None else {tokenizer.detokenize([token]): value for token, value in row}


def completion_choices(
    output: GenerationOutput, prompts: list[str], echo: bool, tokenizer: MegatronTokenizer
) -> list[dict]:
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
            top_logprobs = None
            if output.top_logprobs is not None:
                top = [None] * (start == 0) + output.top_logprobs[index][max(start - 1, 0) :]
                top_logprobs = [_top_dict(tokenizer, row) for row in top[: len(segments)]]
            logprobs = {
                "tokens": segments,
                "token_logprobs": token_logprobs[: len(segments)],
                "top_logprobs": top_logprobs,
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


def _chat_token(tokenizer: MegatronTokenizer, token: int, logprob: float) -> dict:
    text = tokenizer.detokenize([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(output: GenerationOutput, tokenizer: MegatronTokenizer, top: int) -> dict:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]} of the generated tokens."""
    start = output.prompt_lengths[0]
    tokens = output.tokens[0][start:]
    content = []
    for offset, token in enumerate(tokens):
        entry = _chat_token(tokenizer, token, output.logprobs[0][start - 1 + offset])
        alternatives = output.top_logprobs[0][start - 1 + offset][:top] if top else []
        entry["top_logprobs"] = [_chat_token(tokenizer, t, value) for t, value in alternatives]
        content.append(entry)
    return {"content": content}


def _usage(output: GenerationOutput) -> dict[str, int]:
    prompt_tokens = sum(output.prompt_lengths)
    total_tokens = sum(len(ids) for ids in output.tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": total_tokens - prompt_tokens,
        "total_tokens": total_tokens,
    }


class GenerationService:
    """Checks each request alone against the budgets that need the tokenizer and the model, then hands it to
    the batcher."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: MegatronTokenizer,
        limits: ServerLimits,
        runner: ModelRunner,
        dynamic_batching: bool,
        max_batch_wait_s: float,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.limits = limits
        batch_limits = BatchLimits(limits.max_batch_size, limits.max_tokens_to_oom, max_batch_wait_s)
        self.batcher = Batcher(runner, batch_limits, dynamic_batching)

    def check_budget(self, prompts: list[str], params: GenerationParams | BeamSearchParams) -> int:
        """Megatron's "Too many tokens" guard: batch x (longest prompt + generated) <= max_tokens_to_oom, and
        the model's positions. Returns the longest prompt's tokens. Beam search reorders the KV cache, which a
        model rerunning the whole text each step has not and a Retro model's cannot be."""
        if isinstance(params, BeamSearchParams) and not supports_beam_search(self.model):
            raise RequestError(
                "beam search (beam_width) needs a KV cache that beams can reorder, which this model has not (a "
                "Retro model's holds its encoded neighbours): drop beam_width and use greedy (top_k=1) or sampling"
            )
        longest = max(len(ids) for ids in self.tokenizer.tokenize_batch(prompts)) + int(params.add_BOS)
        rows = params.beam_width if isinstance(params, BeamSearchParams) else len(prompts)
        total = rows * (longest + params.tokens_to_generate)
        if total > self.limits.max_tokens_to_oom:
            raise RequestError(f"Too many tokens.  {total} is greater than {self.limits.max_tokens_to_oom}")
        limit = max_sequence_length(self.model)
        if longest + params.tokens_to_generate > limit:
            raise RequestError(
                f"Length of prompt + tokens_to_generate longer than allowed: {longest} + "
                f"{params.tokens_to_generate} tokens > {limit} (the model's max_position_embeddings)"
            )
        return longest

    async def generate(
        self, prompts: list[str], params: GenerationParams | BeamSearchParams
    ) -> GenerationOutput | BeamSearchOutput:
        longest = await run_in_threadpool(self.check_budget, prompts, params)
        return await asyncio.wrap_future(self.batcher.submit(Work(tuple(prompts), params), longest))


async def read_json_body(request: Request, limit: int) -> dict:
    """The request's JSON object, refusing bodies over `limit` bytes without reading them whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body is {declared} bytes; the limit is {limit} (--max-request-bytes)")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestError(f"request body is over {limit} bytes (--max-request-bytes)")
    except ClientDisconnect:
        expected = declared if declared is not None and declared.isdigit() and len(declared) < 20 else "?"
        raise ClientGone(
            f"client {_client(request)} disconnected after sending {len(body)} of {expected} bytes of its "
            f"{request.method} {request.url.path} request; nothing answered"
        ) from None
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError("request body is nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    return data


def client_gone(gone: ClientGone) -> Response:
    """One bounded log line for a client that left mid-request (no traceback: a client can do it at will)."""
    logger.warning("%s", gone)
    return Response(status_code=400)


def create_app(
    model: torch.nn.Module,
    tokenizer: MegatronTokenizer,
    limits: ServerLimits = ServerLimits(),
    model_name: str = "megatron-flow",
    dynamic_batching: bool = True,
    max_batch_wait_s: float = 0.01,
    sft_prompt_format: PromptFormat | None = None,
) -> FastAPI:
    """The FastAPI app serving `model` (this rank's stage of it in a multi-rank server, where this is rank 0);
    run it with uvicorn (see tools/run_text_generation_server.py). Shutting it down stops the follower ranks.
    `sft_prompt_format` is the --sft-tokenizer-prompt-format of a model trained with --sft: chat requests are
    rendered as it was trained."""
    service = GenerationService(
        model, tokenizer, limits, ModelRunner(model, tokenizer), dynamic_batching, max_batch_wait_s
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(service.batcher.close)

    app = FastAPI(title="Megatron-Flow text generation", lifespan=lifespan)
    app.state.service = service

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
            output = await service.generate(prompts, params)
        except ValueError as error:
            return JSONResponse({"message": str(error)}, status_code=400)
        except ClientGone as gone:
            return client_gone(gone)
        except NonFiniteLogitsError as error:
            logger.error("PUT /api: %s", error)
            return JSONResponse({"message": str(error)}, status_code=500)
        if isinstance(output, BeamSearchOutput):
            return {"text": output.texts, "segments": output.segments, "scores": output.scores}
        return {
            "text": output.texts,
            "segments": output.segments,
            "logprobs": output.logprobs,
            "tokens": output.tokens,
        }

    def openai_error(error: ValueError | NonFiniteLogitsError) -> JSONResponse:
        """OpenAI's error object: a 400 for the request's fault, a 500 for the model's (logged once)."""
        model_side = isinstance(error, NonFiniteLogitsError)
        if model_side:
            logger.error("%s", error)
        kind = "server_error" if model_side else "invalid_request_error"
        error_body = {"message": str(error), "type": kind, "param": None, "code": None}
        return JSONResponse({"error": error_body}, status_code=500 if model_side else 400)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await read_json_body(request, limits.max_request_bytes)
            prompts, params, echo = parse_completion_request(body, limits)
            logger.info("completion request from %s: %s", _client(request), request_summary(prompts, params))
            output = await service.generate(prompts, params)
        except (ValueError, NonFiniteLogitsError) as error:
            return openai_error(error)
        except ClientGone as gone:
            return client_gone(gone)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": completion_choices(output, prompts, echo, tokenizer),
            "usage": _usage(output),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await read_json_body(request, limits.max_request_bytes)
            prompt, params = parse_chat_request(body, limits, tokenizer, sft_prompt_format)
            logger.info("chat request from %s: %s", _client(request), request_summary([prompt], params))
            output = await service.generate([prompt], params)
        except (ValueError, NonFiniteLogitsError) as error:
            return openai_error(error)
        except ClientGone as gone:
            return client_gone(gone)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": output.completions[0]},
            "logprobs": chat_logprobs(output, tokenizer, params.top_logprobs)
            if params.return_output_log_probs
            else None,
            "finish_reason": output.finish_reasons[0],
        }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [choice],
            "usage": _usage(output),
        }

    return app
