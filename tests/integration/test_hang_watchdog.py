"""Hangs injected into real jobs started by ``shardwise run``: every rank must exit non-zero within
the hang timeout + 60 s, and the report must name the stuck rank.

Real processes, real Gloo, real signals; each test runs about 10-20 s. The hang timeout is 4 s: the
detection takes the same path at any length, and 4 s leaves the healthy collectives before the fault
(a few milliseconds each) and the heartbeats' staleness limit (T / 2 = 2 s, against a heartbeat every
T / 10 = 0.4 s) a wide margin on a loaded machine. The SIGSTOPped rank is ended by the elastic
agent's SIGTERM-then-SIGKILL teardown, which waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (30 s by
default, 1 s here: a stopped process cannot act on the SIGTERM anyway, and every live rank has
printed its report before the first one exits).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "hang_script.py")
HANG_TIMEOUT_S = 4
NPROC = 3


def _run(mode: str, target: int) -> tuple[int, str, float, float]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDWISE_HANG_TIMEOUT")
    }
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "shardwise",
        "run",
        "--nproc-per-node",
        str(NPROC),
        "--hang-timeout",
        str(HANG_TIMEOUT_S),
        SCRIPT,
        mode,
        str(target),
    ]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    fault_at = None
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:  # note when the fault happened, to time the exit from it
        lines.append(line)
        if fault_at is None and (f"rank {target}: stopping" in line or f"rank {target}: skipping" in line):
            fault_at = time.monotonic()
    rc = proc.wait(timeout=HANG_TIMEOUT_S + 120)
    end = time.monotonic()
    assert fault_at is not None, "".join(lines)
    return rc, "".join(lines), end - fault_at, end - start


def _assert_every_live_rank_reported(out: str, live: list[int], stuck: int) -> None:
    for rank in live:
        # Every live rank prints the verdict and its stacks. Only the first rank to leave is sure to
        # print its exit line: when it exits, the elastic agent stops the others (still non-zero).
        assert re.search(
            rf"\[shardwise watchdog\] rank {rank} \(.*(detected a hang|another rank detected a hang)", out
        ), f"rank {rank} did not report:\n{out}"
        assert re.search(rf"\[shardwise watchdog\] rank {rank} \(.*Python stacks of every thread", out), out
    assert re.search(r"\[shardwise watchdog\] rank \d+ \(.*exiting with code 124", out), out
    assert f"Stuck rank(s): {stuck}." in out, out


@pytest.mark.timeout(150)
def test_rank_that_skips_a_collective_is_named_and_every_rank_exits_nonzero() -> None:
    rc, out, since_fault, _ = _run("skip", 1)
    assert rc != 0, out
    assert since_fault < HANG_TIMEOUT_S + 60, (since_fault, out)
    # Ranks 0 and 2 wait in the last all_reduce; rank 1 skipped one and finished early.
    _assert_every_live_rank_reported(out, [0, 1, 2], stuck=1)
    assert re.search(r"rank 1 \(.*\) has finished at step 6 after issuing 5 collectives on group 0", out), out
    assert "all_reduce #6 on group 0 (shapes [272] Float)" in out, out
    assert "rank 1: finished 6 steps" in out and "rank 0: finished" not in out


@pytest.mark.timeout(150)
def test_sigstopped_rank_is_named_frozen_and_the_job_ends() -> None:
    rc, out, since_fault, _ = _run("stop", 2)
    assert rc != 0, out
    assert since_fault < HANG_TIMEOUT_S + 60, (since_fault, out)
    _assert_every_live_rank_reported(out, [0, 1], stuck=2)
    match = re.search(
        r"rank 2 \(.*, pid (\d+)\) has sent no heartbeat for \d+ s(?: at step \d+)?: the process is frozen", out
    )
    assert match, out
    with pytest.raises(ProcessLookupError):  # the stopped process was ended too (no orphan left)
        os.kill(int(match.group(1)), 0)
    assert "all_reduce #3 on group 0" in out
