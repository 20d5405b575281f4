"""Run a function in a real multi-process gloo group: how TP, SP, PP and DP are tested on CPU."""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Pickled to bytes here: tensors then travel by value, not as shared memory that dies with this process.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - the parent re-raises with this rank's traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PORT_ATTEMPTS = 3


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180) -> list[Any]:
    """Spawn `world_size` gloo ranks, call `fn(rank, world_size, *args)` in each, return the results by rank.

    `fn` must be a top-level function of an importable module (spawned children import it by name). The port is
    free when drawn but may be taken before rank 0 listens on it (another process's connection, the other test
    worker's group): a group that fails to start for that reason alone, before `fn` ran, is started again on
    another port, up to PORT_ATTEMPTS times.
    """
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _run_once(fn, world_size, args, timeout)
        except PortTakenError:
            continue
    return _run_once(fn, world_size, args, timeout)


class PortTakenError(RuntimeError):
    """Rank 0 could not listen on the drawn port: the group never started, `fn` never ran."""


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        # Read results as they come: a child blocks on a full pipe until the parent reads its result.
        while len(outcomes) < world_size and time.monotonic() < deadline:
            if results.empty():
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
                time.sleep(0.01)
                continue
            rank, status, value = results.get()
            outcomes[rank] = (status, pickle.loads(value) if status == "ok" else value)
            if status == "error":
                break  # the other ranks may wait forever on the failed one
        for proc in procs:
            proc.join(max(0.0, min(10.0, deadline - time.monotonic())))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(outcomes.items()) if s == "error"]
    if any("EADDRINUSE" in e and "init_process_group" in e for e in errors):
        raise PortTakenError(f"port {port} taken before the group started\n" + "\n".join(errors))
    if errors:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        raise RuntimeError(f"ranks {missing} returned nothing within {timeout} s (hung or crashed)")
    return [outcomes[r][1] for r in range(world_size)]
