"""Dynamic batching: requests that arrive together run as one batch of prompts through the model.

One thread owns the model (the `ModelRunner`). A request waits in a queue; when the thread takes the oldest
one it keeps collecting for up to `max_wait_s` after that request arrived, then runs the oldest request
together with every waiting request it can share a batch with, within the server's limits (prompts per batch,
Megatron's batch x (longest prompt + tokens to generate) budget). Requests share a batch when their
generation parameters are equal but for the number of tokens to generate (each prompt keeps its own), except
seeded sampling, whose draws would depend on the other rows: it runs alone, as does beam search. Each row of a batch decodes exactly as it would alone (generation.py),
so a request's answer does not depend on its neighbours. With `dynamic=False` every request runs alone, in
arrival order: the one-at-a-time server.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from megatron_train.inference.generation import GenerationOutput, GenerationParams
from megatron_train.inference.ranks import ModelRunner, Work

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 60.0  # an idle multi-rank server pings its followers this often


@dataclass(frozen=True)
class BatchLimits:
    max_prompts: int  # prompts in one batch
    max_tokens: int  # prompts x (longest prompt + tokens to generate), Megatron's --max-tokens-to-oom
    max_wait_s: float  # how long the oldest request waits for others to join it


@dataclass
class _Request:
    work: Work
    longest: int  # tokens in the longest prompt (with BOS)
    future: Future
    arrived: float


def _batchable(work: Work) -> bool:
    params = work.params
    return isinstance(params, GenerationParams) and (params.random_seed < 0 or params.top_k == 1)


def _batch_key(params: GenerationParams) -> GenerationParams:
    """What requests of one batch share: all parameters but the (non-zero) number of tokens to generate."""
    return dataclasses.replace(params, tokens_to_generate=min(params.tokens_to_generate, 1))


def _tokens(requests: list[_Request]) -> int:
    """Megatron's budget of a batch: rows x its longest row (prompt + tokens to generate)."""
    rows = sum(len(request.work.prompts) for request in requests)
    return rows * max(request.longest + request.work.params.tokens_to_generate for request in requests)


def _rows(output: GenerationOutput, start: int, end: int) -> GenerationOutput:
    """Rows start..end - 1 of a batch's output."""
    values = {field.name: getattr(output, field.name) for field in dataclasses.fields(output)}
    return GenerationOutput(
        **{name: None if value is None else value[start:end] for name, value in values.items()}
    )


class Batcher:
    """The queue and the thread that runs its requests in batches (see the module docstring)."""

    def __init__(self, runner: ModelRunner, limits: BatchLimits, dynamic: bool = True) -> None:
        self.runner = runner
        self.limits = limits
        self.dynamic = dynamic
        self.queue: queue.Queue[_Request | None] = queue.Queue()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="generation-batcher", daemon=True)
        self.thread.start()

    def submit(self, work: Work, longest: int) -> Future:
        """Queue `work` (already validated alone); the future gets its output or its ValueError."""
        future: Future = Future()
        if self.closed:
            future.set_exception(RuntimeError("the server is shutting down"))
            return future
        self.queue.put(_Request(work, longest, future, time.monotonic()))
        return future

    def close(self) -> None:
        """Finish what is queued, stop the thread and the follower ranks."""
        if not self.closed:
            self.closed = True
            self.queue.put(None)
            self.thread.join()

    def _loop(self) -> None:
        pending: list[_Request] = []
        stopping = False
        while pending or not stopping:
            if not pending:
                try:
                    request = self.queue.get(timeout=KEEP_ALIVE_S)
                except queue.Empty:
                    self.runner.keep_alive()
                    continue
                if request is None:
                    break
                pending.append(request)
            stopping = self._collect(pending) or stopping
            self._run(self._take(pending))
        self.runner.stop()

    def _collect(self, pending: list[_Request]) -> bool:
        """Add requests arriving until the oldest one's wait is over; True when the stop marker came."""
        first = pending[0]
        deadline = first.arrived + (
            self.limits.max_wait_s if self.dynamic and _batchable(first.work) else 0.0
        )
        while True:
            remaining = deadline - time.monotonic()
            try:
                request = self.queue.get(timeout=remaining) if remaining > 0 else self.queue.get_nowait()
            except queue.Empty:
                return False
            if request is None:
                return True
            pending.append(request)

    def _take(self, pending: list[_Request]) -> list[_Request]:
        """The oldest request and the waiting ones that can join its batch, removed from `pending`."""
        batch = [pending.pop(0)]
        if not (self.dynamic and _batchable(batch[0].work)):
            return batch
        key = _batch_key(batch[0].work.params)
        rows = len(batch[0].work.prompts)
        for request in list(pending):
            if not _batchable(request.work) or _batch_key(request.work.params) != key:
                continue
            if rows + len(request.work.prompts) > self.limits.max_prompts:
                continue
            if _tokens([*batch, request]) > self.limits.max_tokens:
                continue
            batch.append(request)
            pending.remove(request)
            rows += len(request.work.prompts)
        return batch

    def _run(self, batch: list[_Request]) -> None:
        prompts = tuple(prompt for request in batch for prompt in request.work.prompts)
        work = batch[0].work
        if len(batch) > 1:
            budgets = tuple(r.work.params.tokens_to_generate for r in batch for _ in r.work.prompts)
            params = dataclasses.replace(work.params, tokens_to_generate=max(budgets))
            work = Work(prompts, params, budgets if min(budgets) < max(budgets) else None)
        started = time.perf_counter()
        try:
            output = self.runner.run(work)
        except Exception as error:  # noqa: BLE001 - every request of the batch gets it (ValueError: a 400)
            for request in batch:
                request.future.set_exception(error)
            return
        elapsed = time.perf_counter() - started
        if isinstance(output, GenerationOutput):
            generated = sum(len(ids) - n for ids, n in zip(output.tokens, output.prompt_lengths, strict=True))
            logger.info(
                "batch of %d request(s), %d prompt(s): %d tokens in %.2f s (%.1f tokens/s)",
                len(batch), len(prompts), generated, elapsed, generated / max(elapsed, 1e-9),
            )  # fmt: skip
            start = 0
            for request in batch:
                end = start + len(request.work.prompts)
                request.future.set_result(_rows(output, start, end))
                start = end
        else:
            batch[0].future.set_result(output)
