"""Shared fixtures: process pools that live for the whole session (see shardwise.testing); the guard
that fails a test taking over 90 s without an allowance (tests/time_limit.py)."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Callable, Iterator

import pytest

from shardwise.testing import WorkerPool
from tests.time_limit import pytest_configure, pytest_runtest_makereport  # noqa: F401 - the slow-test guard (its doc)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # makes `tests.` importable in the worker processes too
# plan="auto" caches this machine's calibration; tests measure into a directory of their own
# (inherited by the worker processes), never into the user's ~/.cache.
os.environ.setdefault("SHARDWISE_CACHE_DIR", tempfile.mkdtemp(prefix="shardwise-test-cache-"))


@pytest.fixture(scope="session")
def pools() -> Iterator[Callable[[int], WorkerPool]]:
    """``pools(n)``: a pool of n Gloo processes, created once per session and shared by tests."""
    cache: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in cache:
            cache[world_size] = WorkerPool(world_size, timeout_s=180.0)
        return cache[world_size]

    yield get
    for pool in cache.values():
        pool.close()


@pytest.fixture()
def dist2(pools: Callable[[int], WorkerPool]) -> WorkerPool:
    return pools(2)


@pytest.fixture()
def dist4(pools: Callable[[int], WorkerPool]) -> WorkerPool:
    return pools(4)
