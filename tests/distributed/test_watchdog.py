"""The hang watchdog inside a live 4-process Gloo world (the pool's processes must survive, so the
watchdog's exit function is replaced by one that records the exit code; the real exit is tested
end to end through ``shardwise run`` in tests/integration/test_hang_watchdog.py)."""

from __future__ import annotations

import os
import tempfile
import time
import uuid

import torch
import torch.distributed as dist

from shardwise.runtime.watchdog import HANG_EXIT_CODE, Watchdog, in_flight_collectives, side_store


def _busy_until_reported(codes: list[int], limit_s: float) -> None:
    """Compute (sleep, outside any collective) until this rank's watchdog has reached its verdict and
    called its exit function, at most ``limit_s``: as long as the stall lasts, and no longer."""
    deadline = time.monotonic() + limit_s
    while not codes and time.monotonic() < deadline:
        time.sleep(0.1)


def _late_rank(namespace: str, late: int, limit_s: float):
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "500")  # the recorder reads it lazily
    rank = dist.get_rank()
    codes: list[int] = []
    with tempfile.TemporaryFile("w+") as out:
        store = side_store(dist.distributed_c10d._get_default_store(), namespace)
        # Timeouts of seconds, not fractions: on 2 shared cores a heartbeat thread can be starved for ~1 s.
        dog = Watchdog(store, rank=rank, world_size=dist.get_world_size(), timeout_s=4.0, interval_s=0.3, grace_s=3.0,
                       exit_fn=codes.append, stream=out).start()
        if rank == late:
            _busy_until_reported(codes, limit_s)  # computing, not in any collective, until the verdict is out
        t = torch.ones(4)
        dist.all_reduce(t)
        dog.close(wait_for_peers=False)
        out.seek(0)
        text = out.read()
    return codes, dog.report, text, t.tolist()


def test_late_rank_is_named_and_every_rank_reports(dist4) -> None:
    results = dist4.run(_late_rank, uuid.uuid4().hex, 2, 60.0)
    reports = {r[1] for r in results}
    assert len(reports) == 1  # every rank prints the same verdict
    report = reports.pop()
    assert "Stuck rank(s): 2." in report, report
    assert "rank 2 (" in report and "did not arrive at all_reduce" in report and "not inside any collective" in report
    for rank, (codes, _, text, value) in enumerate(results):
        assert codes == [HANG_EXIT_CODE]
        assert f"[shardwise watchdog] rank {rank} (" in text
        assert "Python stacks of every thread" in text and "_late_rank" in text  # the main thread's frame
        assert value == [4.0] * 4  # the collective completed once rank 2 woke up


def _healthy(namespace: str):
    rank = dist.get_rank()
    codes: list[int] = []
    store = side_store(dist.distributed_c10d._get_default_store(), namespace)
    dog = Watchdog(store, rank=rank, world_size=dist.get_world_size(), timeout_s=4.0, interval_s=0.2,
                   exit_fn=codes.append).start()
    for step in range(1, 16):
        t = torch.ones(64)
        dist.all_reduce(t)
        time.sleep(0.05)
        dog.step(step)
    dog.close()  # waits for every rank to finish
    return codes, dog.report, in_flight_collectives()


def test_healthy_job_is_left_alone(dist4) -> None:
    for codes, report, flights in dist4.run(_healthy, uuid.uuid4().hex):
        assert codes == [] and report is None and flights == []


def _stuck_outside_collectives(namespace: str):
    rank = dist.get_rank()
    codes: list[int] = []
    with tempfile.TemporaryFile("w+") as out:
        store = side_store(dist.distributed_c10d._get_default_store(), namespace)
        dog = Watchdog(store, rank=rank, world_size=dist.get_world_size(), timeout_s=30.0, step_timeout_s=1.0,
                       interval_s=0.2, grace_s=2.0, exit_fn=codes.append, stream=out).start()
        dog.step(7)
        _busy_until_reported(codes, 60.0)  # every rank is stuck in its step, none in a collective
        dog.close(wait_for_peers=False)
    return codes, dog.report


def test_step_timeout_reports_a_step_that_does_not_advance(dist4) -> None:
    results = dist4.run(_stuck_outside_collectives, uuid.uuid4().hex)
    report = results[0][1]
    assert all(r[1] == report for r in results) and all(r[0] == [HANG_EXIT_CODE] for r in results)
    assert "step 7 has made no progress" in report and "stuck outside any collective at step 7" in report
