import pytest
import torch
import torch.distributed as dist

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
