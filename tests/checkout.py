"""The environment of a subprocess that must run this checkout's code, and how a server a test
started ends (standard library only).

``PYTHONPATH`` puts the checkout's ``src/`` first, then the repository root (for the ``tests``
package), so a job started by a test imports the shardwise under test even when another checkout of
it is installed (a second git worktree, an editable install pointing elsewhere); in a fresh clone
with its own editable install the two agree."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def checkout_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with this checkout first on ``PYTHONPATH``, ``OMP_NUM_THREADS=1``,
    dependency warnings off, and ``extra`` on top."""
    path = os.pathsep.join([str(REPO / "src"), str(REPO)])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """End a server a test started: SIGTERM, then SIGKILL if it is still running after ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
