"""How a ``shardwise train`` run ended, as the command reports it: the summary of this run, the
command that continues it, and the exit status.

Exit status: 0 when the run reached its last step; ``128 + signal`` when a signal cut it short
(143 for SIGTERM, 138 for SIGUSR1), whoever received the signal (the command, or only a worker),
because the run is then unfinished but resumable, and that is the status a scheduler or a wrapper
script reads as "stopped from outside: run it again" (see docs/checkpointing.md). Failures stay 1,
bad input 2.
"""

from __future__ import annotations

import json
import os
import shlex
import signal

from shardwise.checkpoint import commit as cm
from shardwise.jobs.summary import JobSummary


def read_summary(run_dir: str, *, since: float) -> JobSummary | None:
    """This run's ``summary.json`` (written at or after ``since``, a ``time.time()``), else None: a
    summary left by an earlier run in the same directory must not describe this one."""
    path = os.path.join(run_dir, "summary.json")
    try:
        if os.path.getmtime(path) < since:
            return None
        with open(path) as fh:
            return JobSummary(**json.load(fh))
    except (OSError, ValueError, TypeError):
        return None


def resume_command(run_dir: str, *, max_restarts: int = 0, hang_timeout: float | None = None) -> str:
    """The command that continues this run: its own resolved configuration, resumed."""
    parts = ["shardwise", "train", "--config", os.path.join(run_dir, "config.toml"), "--resume", "auto"]
    if max_restarts:
        parts += ["--max-restarts", str(max_restarts)]
    if hang_timeout is not None:
        parts += ["--hang-timeout", f"{hang_timeout:g}"]
    return " ".join(shlex.quote(p) for p in parts)


def exit_status(summary: JobSummary) -> int:
    """0 for a finished (or early-stopped) run, 128 + signal for a pre-empted one."""
    if summary.stopped == "preempted" and summary.stop_signal:
        try:
            return 128 + int(signal.Signals[summary.stop_signal])
        except KeyError:
            return 128 + int(signal.SIGTERM)
    return 0


def newest_checkpoint(run_dir: str) -> str:
    """Words for the newest complete checkpoint of ``run_dir`` (when the workers could not report)."""
    newest = cm.latest_complete(os.path.join(run_dir, "checkpoints"), level="size")
    return (
        f"newest complete checkpoint: step {newest.step} at {newest.path}" if newest else "no complete checkpoint yet"
    )
