"""Shared fixtures: process pools that live for the whole session (see shardwise.testing), closed
when the suite leaves the folder of the tests that use them (an idle pool's Gloo threads wake every few milliseconds:
about 4% of a core per worker, through the whole rest of the suite); the guard that fails a test
taking over 90 s without an allowance (tests/time_limit.py)."""

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


POOL_FIXTURES = frozenset({"pools", "dist2", "dist4"})
_POOLS = pytest.StashKey[dict[int, WorkerPool]]()
_POOL_DIRS = pytest.StashKey[set]()


@pytest.fixture(scope="session")
def pools(request: pytest.FixtureRequest) -> Iterator[Callable[[int], WorkerPool]]:
    """``pools(n)``: a pool of n Gloo processes, created once per session and shared by tests."""
    cache = request.config.stash.setdefault(_POOLS, {})

    def get(world_size: int) -> WorkerPool:
        if world_size not in cache:
            cache[world_size] = WorkerPool(world_size, timeout_s=180.0)
        return cache[world_size]  # a closed pool starts again on its next run

    yield get
    _close_pools(request.config)


def _close_pools(config: pytest.Config) -> None:
    for pool in config.stash.get(_POOLS, {}).values():
        pool.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_POOL_DIRS] = {item.path.parent for item in items if POOL_FIXTURES & set(getattr(item, "fixturenames", ()))}


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Close the pools when the next test is outside the folders of the tests that use them (one
    close in a serial run; under pytest-xdist a worker that comes back reopens them)."""
    if nextitem is None or nextitem.path.parent not in item.config.stash.get(_POOL_DIRS, set()):
        _close_pools(item.config)


@pytest.fixture()
def dist2(pools: Callable[[int], WorkerPool]) -> WorkerPool:
    return pools(2)


@pytest.fixture()
def dist4(pools: Callable[[int], WorkerPool]) -> WorkerPool:
    return pools(4)
