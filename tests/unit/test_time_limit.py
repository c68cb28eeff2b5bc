"""The slow-test guard (tests/time_limit.py): over the limit fails, an allowance needs a reason."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.time_limit import REFERENCE_PROBE_S, Allowance, load_factor, parallel_factor, probe_s, speed_factor, verdict

REPO = Path(__file__).resolve().parents[2]


def test_load_factor_is_one_when_idle_and_load_per_core_when_busy() -> None:
    assert load_factor(0.3, 2) == 1.0 and load_factor(2.0, 2) == 1.0
    assert load_factor(13.0, 2) == 6.5 and load_factor(5.0, 0) == 5.0


def test_speed_factor_is_one_on_a_machine_as_fast_and_the_ratio_on_a_slower_one() -> None:
    assert speed_factor(REFERENCE_PROBE_S) == 1.0 and speed_factor(REFERENCE_PROBE_S / 3) == 1.0
    assert speed_factor(2 * REFERENCE_PROBE_S) == 2.0
    assert 0 < probe_s(repeats=1) < 60  # it measures something


def test_parallel_factor_is_the_number_of_xdist_workers() -> None:
    assert (
        parallel_factor(None) == 1.0
        and parallel_factor("") == 1.0
        and parallel_factor("2") == 2.0
        and parallel_factor("0") == 1.0
    )


def test_verdict_names_the_time_the_limit_and_the_way_out() -> None:
    assert verdict(89.0, Allowance(90.0, None), 1.0) is None
    message = verdict(91.0, Allowance(90.0, None), 1.0)
    assert message and "91.0 s" in message and "90 s" in message and "slow_allowed(seconds=" in message
    assert verdict(91.0, Allowance(90.0, None), 1.5) is None  # a busy machine: 135 s
    assert "x1.5 for this machine's load and speed and the tests beside it" in verdict(
        140.0, Allowance(90.0, None), 1.5
    )
    assert verdict(150.0, Allowance(200.0, "a whole calibration"), 1.0) is None
    assert "allowance of 200 s" in verdict(250.0, Allowance(200.0, "a whole calibration"), 1.0)


def test_a_slow_test_fails_unless_it_has_an_allowance_with_a_reason(tmp_path: Path) -> None:
    """A real pytest session (limit 0.3 s): the slow test errors at teardown, the allowed one passes,
    a failed one is reported as failed only, and an allowance without a reason is a usage error."""
    (tmp_path / "conftest.py").write_text(
        "from tests.time_limit import pytest_configure, pytest_runtest_makereport  # noqa\n"
    )
    (tmp_path / "test_it.py").write_text(textwrap.dedent("""
        import time
        import pytest

        def test_quick():
            pass

        def test_slow():
            time.sleep(0.6)

        @pytest.mark.slow_allowed(seconds=5, why="sleeps on purpose")
        def test_allowed():
            time.sleep(0.6)

        def test_slow_and_failing():
            time.sleep(0.6)
            assert False
    """))
    env = {**os.environ, "SHARDWISE_TEST_LIMIT_S": "0.3", "PYTHONPATH": str(REPO)}
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--rootdir",
        str(tmp_path),
        str(tmp_path),
    ]
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 3 passed, 1 error" in out, out  # test_slow: its call passed, its teardown errs
    assert "ERROR test_it.py::test_slow - " in out, out
    assert "over the suite's limit of 0.3 s: make it faster" in out, out
    assert "test_allowed" not in out.split("short test summary")[-1], out
    (tmp_path / "test_it.py").write_text(
        "import pytest\n\n@pytest.mark.slow_allowed(seconds=5)\ndef test_no_reason():\n    pass\n"
    )
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "needs seconds=<positive number> and why=" in done.stdout + done.stderr, (
        done.stdout + done.stderr
    )
