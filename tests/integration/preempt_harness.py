"""Helpers for the pre-emption tests: start ``shardwise train`` (or a script) as a real process
tree, wait until it trains, signal it, find its workers, read what it logged. No tests here."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shardwise.launch.forward import child_pids
from tests.checkout import checkout_env

REPO = Path(__file__).resolve().parents[2]
STEPS = 240
TINY = ["--model.layers=1", "--model.hidden=32", "--model.heads=2", "--model.seq_len=32", "--data.max_chars=20000",
        "--train.global_batch_size=8", "--train.log_every=1", "--train.eval_every=30", "--train.eval_windows=8",
        "--sample.chars=0", "--checkpoint.every_n_steps=40"]


def env(**extra: str) -> dict[str, str]:
    out = checkout_env(PYTHONUNBUFFERED="1")
    out.pop("SHARDWISE_FAULT", None)
    out.update(extra)
    return out


def train_args(name: str, *extra: str, steps: int = STEPS, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "shardwise", "train", "--nproc", str(nproc), f"--run.name={name}", *TINY,
            "--max-steps", str(steps), "--hang-timeout", "60", *extra]


@dataclass
class Started:
    """A process tree started by a test: the launcher, the workers once seen, its output files."""

    proc: subprocess.Popen
    out: Path
    err: Path
    workers: tuple[int, ...] = ()

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def find_workers(self, count: int, timeout: float = 120, pid: int | None = None) -> tuple[int, ...]:
        """The ``count`` children of ``pid`` (default: the launcher), once they all exist."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kids = tuple(child_pids(pid or self.proc.pid))
            if len(kids) >= count:
                self.workers = kids
                return kids
            time.sleep(0.2)
        raise AssertionError(f"{count} workers did not start within {timeout} s:\n{self.stderr[-3000:]}")

    def kill_all(self) -> None:
        """Leave nothing behind, whatever happened (SIGKILL to the launcher's group and the workers)."""
        for pid in self.workers:
            _kill(pid)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait(30)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start(args: list[str], cwd: Path, name: str, **extra_env: str) -> Started:
    out, err = cwd / f"{name}.out", cwd / f"{name}.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(args, cwd=cwd, env=env(**extra_env), stdout=o, stderr=e, start_new_session=True)
    return Started(proc, out, err)


def run(args: list[str], cwd: Path, name: str, timeout: float = 300, **extra_env: str) -> Started:
    started = start(args, cwd, name, **extra_env)
    try:
        started.wait(timeout)
    finally:
        started.kill_all()
    return started


def wait_for_rows(metrics: Path, rows: int, started: Started, timeout: float = 120) -> None:
    """Until ``metrics.csv`` holds ``rows`` data rows: training is under way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) > rows:
            return
        if started.proc.poll() is not None:
            raise AssertionError(
                f"the run ended (rc {started.proc.returncode}) before it logged {rows} rows:\n{started.stderr[-3000:]}"
            )
        time.sleep(0.1)
    raise AssertionError(f"{metrics} did not reach {rows} rows within {timeout} s")


def alive(pids: tuple[int, ...]) -> list[int]:
    """The ones still running (zombies, dead but not reaped, do not count)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


def wait_gone(pids: tuple[int, ...], timeout: float) -> float:
    """Seconds until every pid has exited; raises if some are still alive after ``timeout``."""
    start_t = time.monotonic()
    while alive(pids):
        if time.monotonic() - start_t > timeout:
            raise AssertionError(f"processes {alive(pids)} still alive {timeout} s later (orphans)")
        time.sleep(0.1)
    return time.monotonic() - start_t


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def losses_by_step(rows: list[dict[str, str]], key: str = "loss") -> list[tuple[int, str]]:
    """(step, value) of every row that has ``key``, in file order (value as written, for bitwise comparison)."""
    return [(int(r["step"]), r[key]) for r in rows if r.get(key)]


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard shows them: its reader applies the purge of a resumed run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]
