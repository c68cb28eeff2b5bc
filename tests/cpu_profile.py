"""Where the suite's time goes: ``make test-profile`` (``pytest --profile-out=test-profile.md``)
writes a table of CPU-seconds and wall seconds per test file, and ``tests/profile.json`` (per file
and per pytest-xdist group: what tests/suite_order.py orders the groups by).

A test's wall seconds are its setup + call + teardown. Its CPU-seconds are user + system time of
the pytest process and of every process below it, spent between its setup's start and its
teardown's end: this process's own (``getrusage(RUSAGE_SELF)``), its children that ended and were
waited for (``getrusage(RUSAGE_CHILDREN)``, which holds their own waited-for children), and the
processes still running below it (``/proc/<pid>/stat``: utime + stime + cutime + cstime; the
session's Gloo pools, the docs' zygote). A process that was running when the test started and
ended during it is counted from the test's start only. Under pytest-xdist each worker measures
its tests and the controller writes the table; the other tests running beside a test on the same
cores slow its wall time, not its CPU time.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
import pytest

OPTION = "--profile-out"
_START = pytest.StashKey[tuple]()
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def addoption(parser: pytest.Parser) -> None:
    parser.addoption(OPTION, default=None, metavar="FILE.md",
                     help="write CPU-seconds and wall seconds per test file to FILE.md (and tests/profile.json)")


def _own_cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def descendants_cpu(root: int | None = None) -> dict[int, float]:
    """CPU-seconds (with their waited-for children's) of every live process below ``root``."""
    root = os.getpid() if root is None else root
    parent, cpu = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(name)
        parent[pid] = int(fields[1])  # fields[0] is the state, then ppid
        cpu[pid] = sum(int(x) for x in fields[11:15]) / _TICK  # utime stime cutime cstime
    below, frontier = {}, [root]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for kid in children.get(frontier.pop(), []):
            below[kid] = cpu[kid]
            frontier.append(kid)
    return below


def start(item: pytest.Item) -> None:
    if item.config.getoption(OPTION, None):
        item.stash[_START] = (time.monotonic(), _own_cpu(), descendants_cpu())


def stop(item: pytest.Item) -> None:
    begun = item.stash.get(_START, None)
    if begun is None:
        return
    t0, own0, below0 = begun
    below1 = descendants_cpu()
    cpu = _own_cpu() - own0 + sum(c - below0.get(pid, 0.0) for pid, c in below1.items())
    cpu -= sum(c for pid, c in below0.items() if pid not in below1)  # counted whole by whoever waited for it
    from tests.suite_order import group_of

    item.user_properties.append(
        ("profile", {"wall_s": time.monotonic() - t0, "cpu_s": max(0.0, cpu), "group": group_of(item)})
    )


def write(config: pytest.Config, teardowns: list[pytest.TestReport], wall_s: float) -> None:
    """The table and tests/profile.json, from every test's teardown report (its measurement)."""
    out = config.getoption(OPTION, None)
    if not out or hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller writes
        return
    rows: dict[str, list[dict[str, float]]] = {}
    for report in teardowns:
        for key, value in report.user_properties:
            if key == "profile":
                rows.setdefault(report.nodeid.split("::", 1)[0], []).append(value)
    files = {
        f: {"tests": len(r), "cpu_s": sum(x["cpu_s"] for x in r), "wall_s": sum(x["wall_s"] for x in r)}
        for f, r in rows.items()
    }
    groups: dict[str, float] = {}
    for r in rows.values():
        for x in r:
            groups[x["group"]] = groups.get(x["group"], 0.0) + x["wall_s"]
    Path(out).write_text(table(files, wall_s))
    from tests.suite_order import PROFILE

    PROFILE.write_text(
        json.dumps({"files": files, "groups": {g: round(s, 1) for g, s in sorted(groups.items())}}, indent=1) + "\n"
    )


def table(files: dict[str, dict[str, float]], wall_s: float) -> str:
    """The Markdown table, the most CPU first, and the totals."""
    lines = ["| file | tests | CPU-s | wall s |", "|---|---:|---:|---:|"]
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["cpu_s"]):
        lines.append(f"| {name} | {f['tests']} | {f['cpu_s']:.1f} | {f['wall_s']:.1f} |")
    cpu, tests = sum(f["cpu_s"] for f in files.values()), sum(f["tests"] for f in files.values())
    lines.append(f"| **total** ({len(files)} files; the session took {wall_s:.0f} s) | {tests} | {cpu:.1f} | "
                 f"{sum(f['wall_s'] for f in files.values()):.1f} |")
    return "\n".join(lines) + "\n"

