"""Who runs the model in a server: rank 0 answers HTTP and the other ranks follow it.

Megatron's text generation server: rank 0 takes the request, tells every rank what to run
(`send_do_generate` + the broadcast of the prompts and settings) and all ranks run the generation loop
together, each on its TP slice of its pipeline stage. Here the message is the whole `Work` (prompts and
parameters, pickled by `broadcast_object_list` from rank 0 only, never from a client); every rank tokenizes
the prompts itself. An idle server sends a keep-alive now and then so the followers' waiting broadcast does
not reach the process group's timeout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_train.inference.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from megatron_train.inference.generation import (
    GenerationOutput,
    GenerationParams,
    NonFiniteLogitsError,
    generate,
)
from megatron_train.tokenizer.base import MegatronTokenizer

logger = logging.getLogger(__name__)

_KEEP_ALIVE = "keep-alive"
_STOP = "stop"


@dataclass(frozen=True)
class Work:
    """One model call: sampling/greedy generation for `prompts`, or a beam search for the one prompt."""

    prompts: tuple[str, ...]
    params: GenerationParams | BeamSearchParams
    tokens_per_prompt: tuple[int, ...] | None = None  # a batch of requests: each prompt's own budget


def run_work(
    model: torch.nn.Module, tokenizer: MegatronTokenizer, work: Work
) -> GenerationOutput | BeamSearchOutput:
    if isinstance(work.params, BeamSearchParams):
        return beam_search(model, tokenizer, work.prompts[0], work.params)
    return generate(model, tokenizer, list(work.prompts), work.params, work.tokens_per_prompt)


def _is_multi_rank() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


class ModelRunner:
    """Runs work on the model; in a multi-rank server (this is rank 0) the other ranks are sent it first.
    Only one thread may call it: the collectives of two calls must not interleave."""

    def __init__(self, model: torch.nn.Module, tokenizer: MegatronTokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer

    def run(self, work: Work) -> GenerationOutput | BeamSearchOutput:
        self._send(work)
        return run_work(self.model, self.tokenizer, work)

    def keep_alive(self) -> None:
        self._send(_KEEP_ALIVE)

    def stop(self) -> None:
        """Let the followers return (the server is shutting down)."""
        self._send(_STOP)

    @staticmethod
    def _send(message: Work | str) -> None:
        if _is_multi_rank():
            dist.broadcast_object_list([message], src=0)


def follow(model: torch.nn.Module, tokenizer: MegatronTokenizer) -> None:
    """Ranks other than 0: run what rank 0 sends, until it says stop."""
    while True:
        message: list = [None]
        dist.broadcast_object_list(message, src=0)
        work = message[0]
        if work == _STOP:
            return
        if work == _KEEP_ALIVE:
            continue
        try:
            run_work(model, tokenizer, work)
        except (ValueError, NonFiniteLogitsError) as error:  # rank 0 met the same error at the same step
            logger.warning("rank %d: %s", dist.get_rank(), error)
