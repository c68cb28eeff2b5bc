"""How pytest-xdist shares the suite between its workers (``make test``: ``-n 2 --dist loadgroup
--no-loadscope-reorder``), and the documented commands' figures at the end of a run.

- Groups: a test without an ``xdist_group`` mark gets its file's, so each file runs on one worker
  and builds its module-scoped fixtures once, as with ``--dist loadfile``; a test that should be
  spread carries a group of its own (each documented command does: tests/integration/test_docs_run.py).
- Order: under xdist the groups start longest first (the longest-processing-time rule: the two
  workers end close together). A group's expected seconds are the measured ones in
  ``tests/profile.json`` (``make test-profile`` writes it; until then it holds estimates from the
  slowest tests of a CI log), else the sum of its tests' ``@pytest.mark.expected_s(seconds)``, else
  a guess by folder (:data:`DEFAULT_S`). A serial run keeps the files' order.
- Figures: each documented command's line (ran: wall and CPU seconds; resolved: the run that
  stands for it; skipped: why), printed under ``docs commands`` at the end (``-p no:...`` aside,
  every run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

PROFILE = Path(__file__).resolve().parent / "profile.json"
EXPECTED = "expected_s"
# seconds a test, by folder, without a measurement or a mark: a unit test, one on the session's
# Gloo pools, one that starts commands or processes of its own
DEFAULT_S = {"unit": 0.3, "distributed": 5.0, "integration": 15.0}


def configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{EXPECTED}(seconds): the test's expected seconds, for the order the workers start groups in"
    )
    config.addinivalue_line(
        "markers", "xdist_group(name): tests that run on the same pytest-xdist worker (--dist loadgroup)"
    )


def group_of(item: pytest.Item) -> str:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return item.nodeid.split("::", 1)[0]
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def measured() -> dict[str, float]:
    """The groups' measured wall seconds (tests/profile.json), or nothing."""
    try:
        return {k: float(v) for k, v in json.loads(PROFILE.read_text()).get("groups", {}).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def arrange(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test a group (module doc); under xdist, order the groups longest first."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(item)))
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    known, expected, first = measured(), {}, {}
    for i, item in enumerate(items):
        group = group_of(item)
        mark = item.get_closest_marker(EXPECTED)
        folder = item.nodeid.split("/")[1] if item.nodeid.count("/") > 1 else ""
        expected[group] = expected.get(group, 0.0) + (float(mark.args[0]) if mark else DEFAULT_S.get(folder, 1.0))
        first.setdefault(group, i)
    cost = {g: known.get(g, s) for g, s in expected.items()}
    order = {id(item): (-cost[group_of(item)], first[group_of(item)], i) for i, item in enumerate(items)}
    items.sort(key=lambda item: order[id(item)])


def summary(terminalreporter: pytest.TerminalReporter, teardowns: list[pytest.TestReport]) -> None:
    lines = [v for r in teardowns for k, v in r.user_properties if k == "docs_command"]
    if lines:
        terminalreporter.section("docs commands")
        ran = [line for line in lines if line.startswith("ran")]
        terminalreporter.write_line(
            f"{len(ran)} ran, {sum(1 for x in lines if x.startswith('resolved'))} parsed and resolved, "
            f"{sum(1 for x in lines if x.startswith('skipped'))} skipped"
        )
        for line in sorted(lines):
            terminalreporter.write_line(line)
