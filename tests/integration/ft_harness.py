"""Start a fault-tolerant job (``shardwise run --ft-replicas``) of tests/integration/scripts/ft_train.py,
watch its ``STEP <replica> <step> <pid>`` lines as they come, kill a group's worker, and read what
it left (final weights per group, events, summary.json). Shared by tests/integration/test_ft.py
and bench/ft_trials.py."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.integration.nodes_harness import alive  # noqa: F401 - the tests call h.alive

SCRIPT = Path(__file__).parent / "scripts" / "ft_train.py"
FAST = ["--ft-heartbeat-timeout", "1", "--ft-join-timeout", "5", "--ft-timeout", "10", "--ft-quorum-timeout", "30"]


@dataclass
class Step:
    t: float
    replica: int
    step: int
    pid: int


@dataclass
class FtJob:
    """A running ``shardwise run --ft-replicas`` and the lines it printed so far."""

    proc: subprocess.Popen
    out: Path
    ft_dir: Path
    steps: list[Step] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    _queue: "queue.Queue[str | None]" = field(default_factory=queue.Queue)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def poll(self, timeout: float = 0.1) -> bool:
        """Read the lines printed until now (waiting up to ``timeout`` for one); False once the output ended."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return True
            if line is None:
                return False
            self.lines.append(line)
            parts = line.split()
            if len(parts) == 4 and parts[0] == "STEP":
                self.steps.append(Step(time.time(), int(parts[1]), int(parts[2]), int(parts[3])))

    def wait_for(self, replica: int, step: int, timeout: float) -> Step:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = [s for s in self.steps if s.replica == replica and s.step >= step]
            if hit:
                return hit[0]
            if not self.poll(0.2) and not hit:
                break
        raise TimeoutError(f"replica {replica} did not reach step {step} in {timeout} s:\n" + "".join(self.lines[-40:]))

    def finish(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll(0.5):
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError("the job did not finish:\n" + "".join(self.lines[-60:]))
        return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def start(
    work: Path,
    *,
    replicas: int,
    nproc: int,
    plan: str,
    steps: int,
    sleep_s: float,
    max_restarts: int = 0,
    min_replicas: int = 1,
    kill: str = "",
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> FtJob:
    out, ft_dir = work / "out", work / "ft"
    args = [
        sys.executable,
        "-m",
        "shardwise",
        "run",
        "--ft-replicas",
        str(replicas),
        "--ft-min-replicas",
        str(min_replicas),
        "--ft-dir",
        str(ft_dir),
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        *FAST,
        *(extra or []),
        str(SCRIPT),
        str(out),
        plan,
        str(steps),
        str(sleep_s),
        kill,
    ]
    environ = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ, start_new_session=True
    )
    job = FtJob(proc, out, ft_dir)
    threading.Thread(target=job._pump, daemon=True).start()
    return job


def results(job: FtJob) -> dict[int, dict[str, Any]]:
    import torch

    return {
        int(p.stem[len("replica") :]): torch.load(p, weights_only=False) for p in sorted(job.out.glob("replica*.pt"))
    }


def session_processes(sid: int) -> list[int]:
    """Processes still in the job's session (the launcher leads it; the workers lead their own
    sessions, so the tests also check each worker's pid)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def summarize_file(job: FtJob) -> dict[str, Any]:
    import json

    return json.loads((job.ft_dir / "summary.json").read_text())


def read_events(ft_dir: Path) -> list[dict[str, Any]]:
    from shardwise.launch.ft import read_events as read

    return read(str(ft_dir))
