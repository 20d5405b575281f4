import socket

import pytest
import torch
import torch.distributed as dist

from tests.helpers import distributed
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.processes  # every test here starts processes


def _all_reduce_rank(rank: int, world_size: int, scale: float) -> float:
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")


def test_run_distributed_returns_each_ranks_result():
    assert run_distributed(_all_reduce_rank, 3, 2.0) == [6.0, 6.0, 6.0]


def test_run_distributed_reports_failing_rank():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1:.*boom on rank one"):
        run_distributed(_raise_on_rank_one, 2, timeout=60)


def test_a_port_taken_before_the_group_starts_is_drawn_again(monkeypatch):
    """The drawn port is free when drawn; if something listens on it before rank 0 does (EADDRINUSE in
    init_process_group), the group starts again on another port instead of failing the test."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real_free_port, drawn = distributed.free_port, []

    def free_port() -> int:
        drawn.append(real_free_port() if drawn else taken.getsockname()[1])
        return drawn[-1]

    monkeypatch.setattr(distributed, "free_port", free_port)
    try:
        assert run_distributed(_all_reduce_rank, 2, 1.0, timeout=120) == [1.0, 1.0]
    finally:
        taken.close()
    assert len(drawn) == 2 and drawn[0] != drawn[1]
