"""The rank pool itself: results come back in rank order, failures carry the failing rank's traceback."""
import pytest
import torch
import torch.distributed as dist

from tests.distributed import RankError, run_ranks


def _allreduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise KeyError("planted failure")
    return dist.get_rank()


@pytest.mark.parametrize("world", [2, 4])
def test_pool_runs_collectives(world):
    out = run_ranks(world, _allreduce_rank)
    assert out == [(r, float(sum(range(world)))) for r in range(world)]


def test_pool_reports_rank_traceback_and_recovers():
    with pytest.raises(RankError, match=r"(?s)ranks \[1\].*planted failure"):
        run_ranks(2, _fail_on_rank_one)
    assert run_ranks(2, _allreduce_rank) == [(0, 1.0), (1, 1.0)]
