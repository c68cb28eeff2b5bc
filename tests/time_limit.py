"""The suite's guard against slow tests: a test whose setup + call + teardown takes longer than
the limit fails (an error at its teardown, naming its time and the limit), so a new slow test is
noticed the day it lands.

The limit is ``LIMIT_S`` (90 s) times the machine factor (below), unless the test carries an
allowance: ``@pytest.mark.slow_allowed(seconds=..., why="...")`` (``why`` is required: it says
what the time buys, and is printed with the failure when even the allowance is exceeded).

Machine factor: the larger of two, each at least 1, taken when the session starts (before any
test has run, so it is the machine and other work on it, not this suite), times the number of
pytest-xdist workers that share the machine (``-n 2``: two tests at a time, each with half the
cores a serial run gives it):

- load: ``L / cores``, where ``L`` is the 1-minute load average: on a machine shared with other
  jobs the same test takes proportionally longer, and so may it;
- speed: the time of a fixed single-core loop (:func:`probe_s`, the best of 5) over
  ``REFERENCE_PROBE_S``, its time on the 2-core development machine the 90 s are set on (idle): a
  slower CPU gets a proportionally longer limit, a faster one keeps 90 s.

On the idle development machine the factor is 1 and the limit is exactly 90 s. ``SHARDWISE_TEST_LIMIT_S=N``
sets a fixed limit of N s instead (not scaled by the load; allowances are not scaled either); ``0``
switches the guard off, e.g. under a debugger.

The suite still prints the 25 slowest tests (``--durations=25`` in pyproject.toml's addopts).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest

LIMIT_S = 90.0
# the best of 5 runs of probe_s's loop on the 2-core development machine (Python 3.11, idle)
REFERENCE_PROBE_S = 0.185
MARKER = "slow_allowed"
ENV = "SHARDWISE_TEST_LIMIT_S"
_DURATIONS = pytest.StashKey[dict]()
_SCALE = pytest.StashKey[float]()


@dataclass(frozen=True)
class Allowance:
    seconds: float
    why: str | None  # None: the default limit, no allowance


def load_factor(load_1min: float, cores: int) -> float:
    """How much slower than idle this machine runs a test: 1 when idle, L/cores when busy."""
    return max(1.0, load_1min / max(1, cores))


def probe_s(repeats: int = 5) -> float:
    """The best time of ``repeats`` runs of a fixed pure-Python loop (3e6 multiply-adds): one core's speed."""
    best = float("inf")
    for _ in range(repeats):
        start, total = time.perf_counter(), 0
        for i in range(3_000_000):
            total += i * i % 7
        best = min(best, time.perf_counter() - start)
    return best


def parallel_factor(workers: str | None) -> float:
    """How many tests run at once (``PYTEST_XDIST_WORKER_COUNT``; None: a serial run)."""
    return float(max(1, int(workers))) if workers and workers.isdigit() else 1.0


def speed_factor(probe: float) -> float:
    """How much slower than the development machine this CPU runs the probe (at least 1)."""
    return max(1.0, probe / REFERENCE_PROBE_S)


def allowance(item: pytest.Item, base_s: float) -> Allowance:
    """The test's own allowance (its ``slow_allowed`` marker), or the default limit."""
    mark = item.get_closest_marker(MARKER)
    if mark is None:
        return Allowance(base_s, None)
    seconds, why = mark.kwargs.get("seconds"), mark.kwargs.get("why")
    if not isinstance(seconds, (int, float)) or seconds <= 0 or not isinstance(why, str) or not why.strip():
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.{MARKER} needs seconds=<positive number> and why=\"<the reason>\""
        )
    return Allowance(float(seconds), why.strip())


def verdict(total_s: float, allowed: Allowance, scale: float) -> str | None:
    """None when ``total_s`` is within the (load-scaled) limit, else the failure message."""
    limit = allowed.seconds * scale
    if allowed.seconds <= 0 or total_s <= limit:
        return None
    load = f" (x{scale:.1f} for this machine's load and speed and the tests beside it)" if scale > 1.0 else ""
    if allowed.why is None:
        return (
            f"this test took {total_s:.1f} s (setup + call + teardown), over the suite's limit of {allowed.seconds:g} "
            f"s{load}: "
            f"make it faster (smaller model, fewer steps, a shared fixture), or give it "
            f"@pytest.mark.{MARKER}(seconds=..., why=\"...\") saying why it must be slow"
        )
    return f"this test took {total_s:.1f} s, over its allowance of {allowed.seconds:g} s{load} ({allowed.why})"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(seconds, why): this test may take up to `seconds` (not {LIMIT_S:.0f} s); why it must"
    )
    fixed = ENV in os.environ
    machine = max(load_factor(os.getloadavg()[0], os.cpu_count() or 1), speed_factor(probe_s()))
    config.stash[_SCALE] = 1.0 if fixed else machine * parallel_factor(os.environ.get("PYTEST_XDIST_WORKER_COUNT"))


def _base_s() -> float:
    raw = os.environ.get(ENV)
    if raw is None:
        return LIMIT_S
    try:
        return float(raw)
    except ValueError:
        raise pytest.UsageError(f"{ENV}={raw!r} is not a number of seconds") from None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ANN201 - a hook wrapper
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    spent = item.stash.setdefault(_DURATIONS, {})
    spent[report.when] = report.duration
    if not report.passed:
        spent["failed"] = float("nan")  # a failed or skipped test is reported as that, not as slow
    if report.when != "teardown" or "failed" in spent:
        return
    base = _base_s()
    allowed = allowance(item, base)
    if base <= 0:  # the guard is off
        return
    message = verdict(
        spent.get("setup", 0.0) + spent.get("call", 0.0) + spent["teardown"],
        allowed,
        item.config.stash.get(_SCALE, 1.0),
    )
    if message:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid}: {message}"
