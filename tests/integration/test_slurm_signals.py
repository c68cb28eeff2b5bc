"""The sbatch script of ``shardwise slurm``, run by a real bash with its signal path exercised.

Slurm itself is not here, so two stubs stand in on PATH: ``srun`` drops its own options and execs
the command (one task: ``shardwise run`` on this node; the real srun relays the signals it gets to
its tasks the same way), ``scontrol`` records its arguments. The test sends SIGUSR1 to the batch
shell only, as ``#SBATCH --signal=B:USR1@N`` does before the time limit, and checks that the
workers got it (they saved a checkpoint and stopped, "pre-empted by SIGUSR1"), that ``shardwise
run`` exited 138, that the script requeued the job and that no process was left behind.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
from pathlib import Path

import pytest

from shardwise.checkpoint import commit as cm
from tests.integration.preempt_harness import TINY, run, start, wait_for_rows, wait_gone

SRUN = """#!/bin/bash
# stand-in for Slurm's srun: drop srun's own options, run the task in this process
while [ "$#" -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""
SCONTROL = """#!/bin/bash
echo "$@" >> "$SCONTROL_LOG"
"""


def _stubs(directory: Path) -> None:
    directory.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        path = directory / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.timeout(300)
def test_batch_shell_passes_the_warning_to_the_workers_and_requeues(tmp_path):
    script = tmp_path / "job.sbatch"
    job_args = [*TINY, "--run.name=slurm", "--train.max_steps=5000", "--checkpoint.resume=auto"]
    made = run([sys.executable, "-m", "shardwise", "slurm", "--nodes", "1", "--gpus-per-node", "2", "--time", "0:10:00",
                "--out", str(script), "--", "-m", "shardwise.jobs.train", *job_args], tmp_path, "slurm")
    assert made.proc.returncode == 0, made.stderr
    text = script.read_text()
    assert "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text and "trap " in text

    _stubs(tmp_path / "bin")
    log = tmp_path / "scontrol.log"
    path = f"{tmp_path / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    job = start(["bash", str(script)], tmp_path, "batch", PATH=path, SLURM_JOB_ID="4242", SCONTROL_LOG=str(log))
    run_dir = tmp_path / "runs" / "slurm"
    try:
        launcher = job.find_workers(1)[0]  # the batch shell's child: srun, which became `shardwise run`
        workers = job.find_workers(2, pid=launcher)
        job.workers = (launcher, *workers)  # for the clean-up below
        wait_for_rows(run_dir / "metrics.csv", 15, job)
        os.kill(job.proc.pid, signal.SIGUSR1)  # to the batch shell only, like --signal=B:USR1@120
        assert job.wait(120) == 138, job.stderr[-3000:]
        wait_gone((launcher, *workers), 5)
    finally:
        job.kill_all()
    err = job.stderr
    assert "SIGUSR1 (time-limit warning)" in err and "requeueing job 4242" in err, err[-3000:]
    assert "shardwise run: stopped by SIGUSR1" in err
    assert log.read_text().split() == ["requeue", "4242"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["stopped"], summary["stop_signal"]) == ("preempted", "SIGUSR1")
    assert cm.latest_complete(str(run_dir / "checkpoints")).step == summary["steps"] < 5000
