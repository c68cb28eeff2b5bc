"""Shared fixtures: process pools that live for the whole session (see shardwise.testing), closed
when the next test's file uses none (an idle pool's Gloo threads wake every few milliseconds:
about 4% of a core per worker, through the whole rest of the suite); the guard that fails a test
taking over 90 s without an allowance (tests/time_limit.py); how pytest-xdist's workers share the
suite and the documented commands' figures (tests/suite_order.py); ``--profile-out`` (``make
test-profile``: CPU and wall seconds per file, tests/cpu_profile.py)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Callable, Iterator

import pytest

from shardwise.testing import WorkerPool
from tests import cpu_profile, suite_order, time_limit, worker_forkserver
from tests.time_limit import pytest_runtest_makereport  # noqa: F401 - the slow-test guard (its doc)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # makes `tests.` importable in the worker processes too
# plan="auto" caches this machine's calibration; tests measure into a directory of their own
# (inherited by the worker processes), never into the user's ~/.cache.
os.environ.setdefault("SHARDWISE_CACHE_DIR", tempfile.mkdtemp(prefix="shardwise-test-cache-"))


@pytest.fixture(scope="session", autouse=True)
def worker_server(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The fork server the workers of the suite's ``shardwise run`` jobs come from
    (tests/worker_forkserver.py); a session of unit tests alone starts no worker and no server."""
    if all("unit" in item.path.parts for item in request.session.items):
        yield None
    else:
        yield from worker_forkserver.start()


@pytest.fixture(scope="module", autouse=True)
def _fresh_workers_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """``pytestmark = pytest.mark.fresh_workers``: the file's workers (its module fixtures' too) are fresh."""
    with pytest.MonkeyPatch.context() as patch:
        if request.node.get_closest_marker(worker_forkserver.MARKER):
            patch.delenv(worker_forkserver.FORKSERVER_VAR, raising=False)
        yield


@pytest.fixture(autouse=True)
def _fresh_workers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``@pytest.mark.fresh_workers`` on a test: its workers are new interpreters."""
    if request.node.get_closest_marker(worker_forkserver.MARKER):
        monkeypatch.delenv(worker_forkserver.FORKSERVER_VAR, raising=False)


POOL_FIXTURES = frozenset({"pools", "dist2", "dist4"})
# The pools' ranks fork from one server that imported these once (shardwise.testing: a rank starts
# in milliseconds instead of 2 CPU-seconds of imports, each time a pool starts, recycles or
# recovers from a failure); SHARDWISE_TEST_POOL_START=spawn starts them as fresh interpreters.
POOL_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp", "shardwise.testing",
                "shardwise.parallel", "shardwise.train")
_POOLS = pytest.StashKey[dict[int, WorkerPool]]()
_POOL_FILES = pytest.StashKey[set]()
_STARTED = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    cpu_profile.addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    time_limit.pytest_configure(config)
    suite_order.configure(config)
    config.stash[_STARTED] = time.monotonic()


@pytest.fixture(scope="session")
def pools(request: pytest.FixtureRequest) -> Iterator[Callable[[int], WorkerPool]]:
    """``pools(n)``: a pool of n Gloo processes, created once per session and shared by tests."""
    cache = request.config.stash.setdefault(_POOLS, {})

    def get(world_size: int) -> WorkerPool:
        if world_size not in cache:
            start = os.environ.get("SHARDWISE_TEST_POOL_START", "forkserver")
            cache[world_size] = WorkerPool(world_size, timeout_s=180.0, start_method=start, preload=POOL_PRELOAD)
        return cache[world_size]  # a closed pool starts again on its next run

    yield get
    _close_pools(request.config)


def _close_pools(config: pytest.Config) -> None:
    for pool in config.stash.get(_POOLS, {}).values():
        pool.close()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    suite_order.arrange(config, items)
    config.stash[_POOL_FILES] = {item.path for item in items if POOL_FIXTURES & set(getattr(item, "fixturenames", ()))}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):  # noqa: ANN201 - a hook wrapper
    cpu_profile.start(item)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201 - a hook wrapper
    """Close the pools when the next test's file uses none (under pytest-xdist a worker that comes
    back to such a file reopens them)."""
    yield
    if nextitem is None or nextitem.path not in item.config.stash.get(_POOL_FILES, set()):
        _close_pools(item.config)
    cpu_profile.stop(item)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    suite_order.summary(terminalreporter, _teardowns(terminalreporter))


def pytest_sessionfinish(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    cpu_profile.write(
        session.config, _teardowns(reporter), time.monotonic() - session.config.stash.get(_STARTED, time.monotonic())
    )


def _teardowns(reporter: object) -> list[pytest.TestReport]:
    """Every test's last report (its teardown's: it carries the test's user_properties)."""
    stats = getattr(reporter, "stats", {}) or {}
    return [r for reports in stats.values() for r in reports if getattr(r, "when", None) == "teardown"]


@pytest.fixture()
def dist2(pools: Callable[[int], WorkerPool]) -> WorkerPool:
    return pools(2)


@pytest.fixture()
def dist4(pools: Callable[[int], WorkerPool]) -> WorkerPool:
    return pools(4)
