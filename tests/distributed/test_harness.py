"""The multi-process harness itself: results, failure propagation, hard timeouts, no orphans."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import RankFailed, RanksTimedOut, WorkerPool


def _all_reduce_rank() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 waits here for a rank that never comes
    return 0


def _sleep_on_rank_zero(seconds: float) -> int:
    if dist.get_rank() == 0:
        time.sleep(seconds)
    return dist.get_rank()


def test_results_ordered_by_rank(dist4: WorkerPool) -> None:
    assert dist4.run(_all_reduce_rank) == [(r, 4, 10.0) for r in range(4)]


def test_failure_shows_rank_traceback_and_pool_recovers() -> None:
    pool = WorkerPool(2, timeout_s=60)
    try:
        with pytest.raises(RankFailed, match=r"rank 1 failed(.|\n)*ValueError: boom on rank one"):
            pool.run(_fail_on_rank_one)
        assert not pool._procs  # torn down: no orphan waiting in the barrier
        assert pool.run(_all_reduce_rank) == [(0, 2, 3.0), (1, 2, 3.0)]  # rebuilt on demand
    finally:
        pool.close()


def test_hard_timeout_names_the_stuck_rank() -> None:
    pool = WorkerPool(2, timeout_s=60)
    try:
        procs = None
        with pytest.raises(RanksTimedOut, match=r"ranks \[0\] did not finish"):
            pool.run(_sleep_on_rank_zero, 30.0, timeout_s=2.0)
        procs = pool._procs
        assert procs == []
    finally:
        pool.close()
