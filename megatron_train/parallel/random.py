"""Random number streams for dropout under tensor parallelism, and activation checkpointing that replays them.

Three streams, as in Megatron: the default generator (seeded identically on every TP rank) for work that is
replicated across TP, a tracked 'model-parallel-rng' stream seeded differently on each TP rank for work
on sharded activations (attention heads, sequence-parallel shards), entered with `get_rng_tracker().fork()`, and
a tracked 'expert-parallel-rng' stream seeded per (EP, expert TP) rank for the MoE experts' shards.
On CUDA the tracked states are CUDA generator states; on CPU they are the CPU generator's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from megatron_train.parallel import state

MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
_TENSOR_PARALLEL_SEED_OFFSET = 2718  # Megatron's constants, so seeds match Megatron runs
_EXPERT_PARALLEL_SEED_OFFSET = 1024


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(new_state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(new_state)
    else:
        torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states that `fork(name)` swaps in and out (Megatron's CudaRNGStatesTracker)."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self._running: set[str] = set()  # streams a fork() is on now

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists; call reset() before re-seeding")
        outer = _get_state()
        _manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on stream `name`, then restore the outer stream. The default stream, when never
        seeded, is seeded from `torch.initial_seed()` as `model_parallel_seed` would. A fork inside a fork of
        the same stream (a sequence-parallel block inside another: Retro's encoder) continues that stream
        instead of replaying it from the outer fork's start. The expert stream likewise."""
        if name in self._running:
            yield
            return
        if name not in self.states:
            if name not in _STREAM_SEEDS:
                raise KeyError(f"RNG state {name!r} was never added to the tracker")
            self.add(name, _STREAM_SEEDS[name](torch.initial_seed()))
        outer = _get_state()
        _set_state(self.states[name])
        self._running.add(name)
        try:
            yield
        finally:
            self._running.discard(name)
            self.states[name] = _get_state()
            _set_state(outer)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def _tensor_parallel_seed(seed: int) -> int:
    return seed + _TENSOR_PARALLEL_SEED_OFFSET + state.get_tensor_model_parallel_rank()


def _expert_parallel_seed(seed: int) -> int:
    """Megatron's model_parallel_cuda_manual_seed: each (EP, expert TP) rank draws different experts' shards."""
    ep_rank, etp_rank = state.get_expert_model_parallel_rank(), state.get_expert_tensor_parallel_rank()
    return seed + _EXPERT_PARALLEL_SEED_OFFSET + 100 * ep_rank + etp_rank


_STREAM_SEEDS = {MODEL_PARALLEL_RNG: _tensor_parallel_seed, EXPERT_PARALLEL_RNG: _expert_parallel_seed}


def model_parallel_seed(seed: int) -> None:
    """Seed the default stream with `seed` (same on all TP ranks) and the tracked stream per TP rank.

    Seeds the CPU generator too, so weight initialisation (which draws on the CPU) matches across TP ranks.
    """
    torch.manual_seed(seed)
    _manual_seed(seed)
    _TRACKER.reset()
    for name, stream_seed in _STREAM_SEEDS.items():
        _TRACKER.add(name, stream_seed(seed))


@contextlib.contextmanager
def initialization_stream(seed: int | None, stream: int) -> Iterator[None]:
    """Build the block's weights from the CPU generator seeded by (`seed`, `stream`), then restore the generator.

    `--use-cpu-initialization`: each part of the model (the embedding, each layer by its global number, the
    output layer) draws its full weights from its own stream, so whichever pipeline stage builds it and whatever
    was built before, every TP/PP/DP layout starts from the same weights (docs/architecture.md). No-op when
    `seed` is None.
    """
    global _OPEN_INIT_STREAMS
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed << _INIT_STREAM_BITS) + stream)
        _OPEN_INIT_STREAMS += 1
        try:
            yield
        finally:
            _OPEN_INIT_STREAMS -= 1


_INIT_STREAM_BITS = 20  # streams per seed: seeds 7 and 8 share no stream
_OPEN_INIT_STREAMS = 0


def full_weight_initialization() -> bool:
    """A --use-cpu-initialization stream is open: layers built now draw their full weights on the CPU and keep
    their slice (`layers.parallel_weight`), instead of drawing only their shard (`param_init`)."""
    return _OPEN_INIT_STREAMS > 0


_RECOMPUTING = [0]  # checkpointed blocks being recomputed right now (nested checkpoints count each)


def is_recomputing() -> bool:
    """Whether a `checkpoint`ed block is being recomputed in the backward pass: its forward then runs a second
    time, which must build the same graph but not count what it counts twice (the MoE routers' statistics)."""
    return _RECOMPUTING[0] > 0


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Activation checkpointing (torch.utils.checkpoint, use_reentrant=False) that also replays the tracked
    RNG streams, so dropout inside `fork()` draws the same masks when the block is recomputed (forks that
    were running when the block was first run are running again while it is recomputed)."""
    saved, running = _TRACKER.get_states(), set(_TRACKER._running)

    @contextlib.contextmanager
    def replay_tracked_states() -> Iterator[None]:
        current, current_running = _TRACKER.get_states(), _TRACKER._running
        _TRACKER.set_states(saved)
        _TRACKER._running = set(running)
        _RECOMPUTING[0] += 1
        try:
            yield
        finally:
            _RECOMPUTING[0] -= 1
            _TRACKER.set_states(current)
            _TRACKER._running = current_running

    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: (contextlib.nullcontext(), replay_tracked_states()),
    )
