"""The pieces of pre-emption handling, each on its own (one process, real signals where there are any)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shardwise.checkpoint.signals import PreemptionSignal
from shardwise.errors import ShardwiseError, StoppedBySignal
from shardwise.jobs.outcome import exit_status, read_summary, resume_command
from shardwise.jobs.summary import JobSummary, format_summary
from shardwise.launch.forward import child_pids, forward_signals
from shardwise.launch.sbatch import SbatchSpec, render_sbatch
from shardwise.runtime.settings import read_settings
from shardwise.train.result import stop_of


def test_nested_installs_keep_the_handlers_until_the_last_one():
    previous = signal.getsignal(signal.SIGUSR1)
    outer = PreemptionSignal()
    with outer:
        with outer:  # fit inside the job
            os.kill(os.getpid(), signal.SIGUSR1)
            assert outer.requested and outer.received == signal.SIGUSR1
            outer.consume()
            assert not outer.requested and outer.received == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGUSR1)  # after fit: recorded, not fatal
        assert outer.requested
    assert signal.getsignal(signal.SIGUSR1) is previous and not outer.requested and outer.received is None


def test_stop_of():
    class P:
        signal, checkpoint = "SIGUSR1", "/c/step_00000005"

    assert stop_of(should_stop=True, limit_reached=False, step=5, preemption=P()).reason == "preempted"
    assert stop_of(should_stop=True, limit_reached=True, step=9, preemption=P()) is None  # complete anyway
    assert stop_of(should_stop=True, limit_reached=False, step=5).reason == "stopped"
    assert stop_of(should_stop=False, limit_reached=True, step=9) is None


def _summary(**kw) -> JobSummary:
    base = dict(
        run_dir="runs/x",
        steps=34,
        world_size=2,
        plan="dp=2",
        val_loss=1.5,
        train_loss=1.4,
        unigram_entropy=3.1,
        elapsed_s=1.0,
        params=10,
        sample="",
        total_steps=100,
    )
    return JobSummary(**{**base, **kw})


def test_summary_line_and_exit_status_of_a_cut_short_run():
    resume = resume_command("runs/x", max_restarts=2, hang_timeout=60)
    assert resume == "shardwise train --config runs/x/config.toml --resume auto --max-restarts 2 --hang-timeout 60"
    pre = _summary(stopped="preempted", stop_signal="SIGUSR1", checkpoint="/abs/runs/x/checkpoints/step_00000034")
    text = format_summary(pre, resume)
    assert text.splitlines()[0] == (f"pre-empted by SIGUSR1 at step 34 of 100: checkpoint saved at "
                                    f"/abs/runs/x/checkpoints/step_00000034; resume with: {resume}")
    assert "validation loss" not in text and exit_status(pre) == 138
    early = _summary(stopped="stopped")
    assert format_summary(early).startswith("stopped early at step 34 of 100") and "validation loss" in format_summary(
        early
    )
    assert exit_status(early) == 0 and exit_status(_summary()) == 0
    assert format_summary(_summary()).startswith("validation loss")


def test_a_summary_of_an_earlier_run_is_not_this_runs(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(_summary().__dict__))
    assert read_summary(str(tmp_path), since=time.time() - 60) is not None
    assert read_summary(str(tmp_path), since=time.time() + 60) is None
    assert read_summary(str(tmp_path / "missing"), since=0) is None


def test_stopped_by_signal_is_128_plus_the_signal():
    assert StoppedBySignal("x", signum=signal.SIGTERM).exit_code == 143
    assert isinstance(StoppedBySignal("x", signum=10), ShardwiseError)


def test_settings_read_the_launcher_pid_and_the_grace():
    s = read_settings({"SHARDWISE_LAUNCHER_PID": "1234", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"})
    assert (s.launcher_pid, s.stop_grace_s) == (1234, 45.0)
    assert (read_settings({}).launcher_pid, read_settings({}).stop_grace_s) == (None, 30.0)


_CHILD = """
import signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
print("ready", flush=True)
deadline = time.time() + 30
while not got and time.time() < deadline:
    time.sleep(0.05)
print("got" if got else "timeout", flush=True)
"""


@pytest.mark.timeout(60)
def test_the_launcher_passes_sigusr1_to_its_children_and_survives():
    """The launcher is a fresh process of its own: played by the test process itself, it would pass
    the signal to every other child of this pytest worker too (the docs run's zygote, a pool's
    forkserver), as a launcher does."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", "from tests.unit.test_preemption_parts import _launcher; _launcher()"],
                          cwd=root, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr


def _launcher() -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in child_pids()
        with forward_signals() as forwarded:
            os.kill(os.getpid(), signal.SIGUSR1)  # this test process plays the launcher
        assert forwarded.received == signal.SIGUSR1 and child.pid in forwarded.sent_to
        assert child.stdout.readline().strip() == "got"
        assert child.wait(10) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_sbatch_script_passes_the_warning_on_and_requeues():
    text = render_sbatch(SbatchSpec(script=("train.py",), warning_s=300))
    assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text
    assert "trap " in text and " &\nstep=$!" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    plain = render_sbatch(SbatchSpec(script=("train.py",), requeue=False))
    assert "--requeue" not in plain and "scontrol" not in plain and "trap " in plain
    with pytest.raises(ShardwiseError, match="--warning 0"):
        render_sbatch(SbatchSpec(script=("train.py",), warning_s=0))
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # the script parses


def test_negative_max_restarts_is_one_line(tmp_path, monkeypatch, capsys):
    from shardwise.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--max-restarts", "-1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--max-restarts -1 is negative" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_a_fresh_run_refuses_a_directory_with_checkpoints(tmp_path, monkeypatch, capsys):
    from shardwise.checkpoint import commit as cm
    from shardwise.cli import main

    step = tmp_path / "runs" / "x" / "checkpoints" / cm.step_dirname(7)
    step.mkdir(parents=True)
    cm.commit(str(step), step=7, world_size=1, dp_size=1, plan=None, metrics={})
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--nproc", "1", "--run.name=x"]) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints (newest: step 7)" in err and "--resume auto" in err
