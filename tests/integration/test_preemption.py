"""Pre-emption and restarts of ``shardwise train``, with real process trees and real signals.

- SIGTERM to the command: the workers save, the command says "pre-empted by SIGTERM at step N:
  checkpoint saved at ...; resume with: ...", exits 143 and mentions no rendezvous; the printed
  command resumes, and the resumed run logs exactly what an uninterrupted run logs (every loss,
  bitwise, every step once, in metrics.csv and in TensorBoard);
- SIGUSR1 to the launcher and its workers together (a signal to a whole Slurm job step): the
  launcher survives, the workers save, exit 138, no process left behind;
- the launcher SIGKILLed: its workers save and exit within seconds instead of living on;
- ``--max-restarts 1`` with a worker SIGKILLed: the restart resumes (no flag needed) and metrics.csv
  and TensorBoard hold every step exactly once, equal to the uninterrupted run.

The async-save race at the end of training: tests/distributed/test_checkpoint_async_end.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
from pathlib import Path

import pytest

from shardwise.checkpoint import commit as cm
from tests.integration.preempt_harness import (
    STEPS,
    csv_rows,
    losses_by_step,
    run,
    start,
    tensorboard_scalars,
    train_args,
    wait_for_rows,
    wait_gone,
)

RUNS = "runs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run every interrupted one must reproduce."""
    cwd = tmp_path_factory.mktemp("reference")
    done = run(train_args("ref"), cwd, "ref")
    assert done.proc.returncode == 0, done.stderr[-3000:]
    run_dir = cwd / RUNS / "ref"
    return {"rows": csv_rows(run_dir / "metrics.csv"), "summary": json.loads((run_dir / "summary.json").read_text()),
            "tb_loss": tensorboard_scalars(run_dir, "loss")}


def _assert_same_history(run_dir: Path, reference: dict) -> None:
    rows = csv_rows(run_dir / "metrics.csv")
    for key in ("loss", "val_loss"):
        got, want = losses_by_step(rows, key), losses_by_step(reference["rows"], key)
        steps = [s for s, _ in got]
        assert len(steps) == len(set(steps)), f"{key}: a step logged twice: {steps}"
        assert got == want, f"{key} differs from the uninterrupted run"
    assert [s for s, _ in losses_by_step(rows)] == list(range(1, STEPS + 1))
    tb = tensorboard_scalars(run_dir, "loss")
    assert tb == reference["tb_loss"] and [s for s, _ in tb] == list(range(1, STEPS + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("train_loss", "val_loss", "steps"):
        assert summary[key] == reference["summary"][key], key


@pytest.mark.timeout(600)
def test_sigterm_saves_says_how_to_resume_and_the_resume_is_exact(tmp_path, reference):
    run_dir = tmp_path / RUNS / "term"
    job = start(train_args("term"), tmp_path, "term")
    try:
        workers = job.find_workers(2)  # the command runs the elastic agent; the workers are its children
        wait_for_rows(run_dir / "metrics.csv", 15, job)
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(120) == 143, job.stderr[-3000:]
    finally:
        job.kill_all()
    out, err = job.stdout, job.stderr
    line = next(line for line in out.splitlines() if line.startswith("pre-empted by SIGTERM"))
    match = re.fullmatch(
        r"pre-empted by SIGTERM at step (\d+) of 240: checkpoint saved at (\S+); resume with: (.+)", line
    )
    assert match, line
    step, path, command = int(match.group(1)), match.group(2), match.group(3)
    assert 15 <= step < STEPS and path == str(run_dir / "checkpoints" / cm.step_dirname(step))
    assert cm.verify(path)[0] is not None  # complete
    assert "rendezvous" not in err and "could not meet" not in err, err[-2000:]
    assert "validation loss" not in out  # a pre-emption is not reported as a finished run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["stopped"], summary["stop_signal"], summary["steps"]) == ("preempted", "SIGTERM", step)
    wait_gone(workers, 5)  # the command returned after its workers had exited

    # The printed command continues the run; the two together log what one uninterrupted run logs.
    args = shlex.split(command)
    assert args[:2] == ["shardwise", "train"] and "--resume" in args
    resumed = run([sys.executable, "-m", *args], tmp_path, "resume")
    assert resumed.proc.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint: resumed from step {step}" in resumed.stdout and "validation loss" in resumed.stdout
    _assert_same_history(run_dir, reference)


@pytest.mark.timeout(300)
def test_sigusr1_to_the_launcher_and_its_workers_together_leaves_no_orphans(tmp_path):
    run_dir = tmp_path / RUNS / "usr1"
    job = start(train_args("usr1"), tmp_path, "usr1")
    try:
        workers = job.find_workers(2)
        wait_for_rows(run_dir / "metrics.csv", 15, job)
        for pid in (job.proc.pid, *workers):  # what Slurm does to a job step: every process gets it
            os.kill(pid, signal.SIGUSR1)
        assert job.wait(120) == 138, job.stderr[-3000:]  # the launcher lived on until its workers had saved
        wait_gone(workers, 5)
    finally:
        job.kill_all()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["stopped"], summary["stop_signal"]) == ("preempted", "SIGUSR1")
    assert f"pre-empted by SIGUSR1 at step {summary['steps']} of {STEPS}" in job.stdout
    assert cm.latest_complete(str(run_dir / "checkpoints")).step == summary["steps"]


@pytest.mark.timeout(300)
def test_launcher_killed_its_workers_save_and_exit(tmp_path):
    run_dir = tmp_path / RUNS / "orphan"
    job = start(train_args("orphan", steps=5000), tmp_path, "orphan")
    try:
        workers = job.find_workers(2)
        wait_for_rows(run_dir / "metrics.csv", 15, job)
        job.proc.send_signal(signal.SIGKILL)
        job.wait(30)
        gone_after = wait_gone(workers, 40)  # SIGTERM within a second, a deadline of 30 s after it
    finally:
        job.kill_all()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["stopped"], summary["stop_signal"]) == ("preempted", "SIGTERM"), summary
    assert cm.latest_complete(str(run_dir / "checkpoints")).step == summary["steps"] < 5000
    assert "launcher (pid" in job.stderr and "is gone" in job.stderr
    assert gone_after < 30, gone_after


@pytest.mark.timeout(600)
def test_max_restarts_resumes_and_the_logs_keep_every_step_once(tmp_path, reference):
    run_dir = tmp_path / RUNS / "restart"
    # rank 1 is SIGKILLed at step 57 of the first attempt; the newest checkpoint is step 40
    done = run(train_args("restart", "--max-restarts", "1"), tmp_path, "restart", SHARDWISE_FAULT="rank=1,step=57")
    assert done.proc.returncode == 0, done.stderr[-3000:]
    assert "checkpoint: resumed from step 40" in done.stdout and "validation loss" in done.stdout
    _assert_same_history(run_dir, reference)
