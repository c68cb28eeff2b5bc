"""The suite's own machinery: how pytest-xdist's workers share it (tests/suite_order.py), what
``make test-profile`` measures (tests/cpu_profile.py) and which documented commands are parsed and
resolved instead of run (tests/integration/docs_plan.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import cpu_profile, suite_order

pytest_plugins = ["pytester"]

CONFTEST = """
import pytest
from tests import suite_order

def pytest_configure(config):
    suite_order.configure(config)

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    suite_order.arrange(config, items)
    print("ORDER", [suite_order.group_of(i) + ":" + i.name for i in items])
"""


def _order(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, worker: bool) -> list[str]:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_a="def test_a1(): pass\ndef test_a2(): pass\n",
                        test_b="import pytest\n@pytest.mark.expected_s(50)\ndef test_b1(): pass\n"
                               "@pytest.mark.xdist_group('own')\n@pytest.mark.expected_s(20)\ndef test_b2(): pass\n")
    if worker:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    else:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-s", "-p", "no:cacheprovider")
    line = next(x for x in result.outlines if x.startswith("ORDER"))
    return eval(line[len("ORDER "):])  # noqa: S307 - our own list literal


def test_each_test_gets_its_files_group_and_a_serial_run_keeps_the_order(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _order(pytester, monkeypatch, worker=False) == [
        "test_a.py:test_a1",
        "test_a.py:test_a2",
        "test_b.py:test_b1",
        "own:test_b2",
    ]


def test_under_xdist_the_longest_group_starts_first(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # test_b.py: 50 s expected; `own`: 20 s; test_a.py: two tests without a mark or a measurement (a guess each)
    assert _order(pytester, monkeypatch, worker=True) == [
        "test_b.py:test_b1",
        "own:test_b2",
        "test_a.py:test_a1",
        "test_a.py:test_a2",
    ]


def test_the_measured_seconds_are_read_from_the_profile() -> None:
    groups = suite_order.measured()
    # a skipped or parsed-only documented command measures 0.0 s (rounded to 0.1 s); the rest take time
    assert groups and all(isinstance(v, float) and v >= 0 for v in groups.values())
    assert sum(v > 0 for v in groups.values()) > len(groups) // 2


def test_cpu_of_a_running_child_is_counted() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)",
        ]
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and cpu_profile.descendants_cpu().get(child.pid, 0.0) < 0.3:
            time.sleep(0.1)
        assert cpu_profile.descendants_cpu()[child.pid] >= 0.3
    finally:
        child.kill()
        child.wait()
    assert child.pid not in cpu_profile.descendants_cpu()


def test_the_profile_table_lists_files_by_cpu() -> None:
    text = cpu_profile.table(
        {"a.py": {"tests": 2, "cpu_s": 1.0, "wall_s": 3.0}, "b.py": {"tests": 1, "cpu_s": 5.0, "wall_s": 4.0}}, 9.0
    )
    lines = text.splitlines()
    assert lines[2].startswith("| b.py | 1 | 5.0 | 4.0 |") and lines[3].startswith("| a.py | 2 | 1.0 | 3.0 |")
    assert "| 3 | 6.0 | 7.0 |" in lines[4] and "9 s" in lines[4]


def test_a_documented_command_is_resolved_only_on_the_path_of_one_that_runs() -> None:
    from tests.integration.docs_plan import VALUE_ONLY, plan_commands

    planned = plan_commands(Path("/docs-root"))
    resolved = [p for p in planned if p.same_as is not None]
    assert resolved, "no documented command shares a code path with another"
    for p in resolved:
        first = planned[p.same_as]
        assert first.run is not None and first.same_as is None, (
            f"`{p.cmd.text}` stands on `{first.cmd.text}`, which does not run"
        )
        assert p.cmd.error is None or p.cmd.error == first.cmd.error, f"`{p.cmd.text}` shows a refusal: it runs"
        assert p.why_same
    assert all(why for options in VALUE_ONLY.values() for why in options.values())


def test_under_xdist_each_file_runs_on_one_worker(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """--dist loadgroup with the groups suite_order gives: a file's tests share a worker, so its
    module fixtures are built once (this failed with pytest 9.2 and pytest-xdist 3.8)."""
    pytester.makeconftest(CONFTEST)
    body = ("import os, pytest\n@pytest.fixture(scope='module')\ndef built():\n"
            "    with open('built.txt', 'a') as f: f.write(__name__ + '\\n')\n"
            + "".join(f"def test_{i}(built):\n    with open('ran.txt', 'a') as f:"
                      f" f.write(__name__ + ' ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n" for i in range(4)))
    pytester.makepyfile(test_a=body, test_b=body, test_c=body)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))  # this checkout's tests.suite_order
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder",
                                           "-p", "no:cacheprovider", "-q")
    assert result.ret == 0, result.outlines
    built = (pytester.path / "built.txt").read_text().split()
    assert sorted(built) == ["test_a", "test_b", "test_c"], built  # one module fixture per file
    workers = {}
    for line in (pytester.path / "ran.txt").read_text().splitlines():
        name, worker = line.split()
        workers.setdefault(name, set()).add(worker)
    assert all(len(w) == 1 for w in workers.values()), workers
