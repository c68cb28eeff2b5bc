"""Loopback "nodes" for the node-loss tests and benches: a ``shardwise rendezvous`` store process,
``shardwise run`` agents (each a node: its agent and its workers), and the ways to lose one
(SIGKILL of the whole tree, SIGSTOP/SIGCONT of it). No tests here.

The job is ``scripts/elastic_train.py``: a small MLP under the Trainer, plan ``dp=2,tp=2``, a
checkpoint every few steps, one ``LOSS`` line per step from rank 0, and holds (``--hold-at
STEP:WORLD``) where every rank waits inside a step, so a test acts at a known step.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from tests.checkout import checkout_env

SCRIPT = Path(__file__).parent / "scripts" / "elastic_train.py"
REPO = Path(__file__).resolve().parents[2]
STEPS, SAVE_EVERY = 14, 4  # the job of every node-loss test (one reference run serves them all)
# Fast rendezvous for a test: a silent node is lost after 1 s x 5 missed heartbeats, and a world
# short of its maximum waits 3 s for more nodes. Much shorter heartbeats risk a loaded machine
# declaring a live node dead (a split world); keep torch's defaults (5 s x 3, 30 s) in production.
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5"
LOSS = re.compile(r"LOSS step=(\d+) world=(\d+) plan=(\S+) loss=(\S+)")
WORKER = re.compile(r"^WORKER pid=(\d+)$")


def env(**extra: str) -> dict[str, str]:
    return checkout_env(**extra)


def job_args(
    directory: Path, *, steps: int, save_every: int, plan: str = "dp=2,tp=2", extra: tuple[str, ...] = ()
) -> list[str]:
    return [
        str(SCRIPT),
        "--dir",
        str(directory),
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        "--plan",
        plan,
        *extra,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(root: int) -> list[int]:
    """``root`` and every process below it (workers lead their own sessions, so walk parents)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        out.append(pid)
        frontier.extend(parents.get(pid, ()))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Proc:
    """A process whose output is collected line by line (with the time each line arrived)."""

    def __init__(self, name: str, cmd: list[str], *, extra_env: dict[str, str] | None = None) -> None:
        self.name, self.lines, self.times = name, [], []
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env(**(extra_env or {})),
            cwd=REPO,
            start_new_session=True,
        )
        self.seen: set[int] = {self.proc.pid}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))
            self.times.append(time.monotonic())
            worker = WORKER.match(line)
            if worker:  # a worker forked from the fork server is the server's child, not in the agent's tree
                self.seen.add(int(worker.group(1)))

    def pids(self) -> list[int]:
        found = tree(self.proc.pid) if self.proc.poll() is None else []
        self.seen.update(found)
        return found

    def signal_all(self, sig: int) -> list[int]:
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def kill(self) -> None:
        """Lose the node: SIGKILL its agent and workers, no goodbye."""
        self.signal_all(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()

    def orphans(self) -> list[int]:
        """Processes of this node still alive (after it ended)."""
        return [pid for pid in self.seen if alive(pid)]


def rendezvous_server(port: int) -> Proc:
    """``shardwise rendezvous`` on ``port``, ready when this returns."""
    server = Proc("rdzv", [sys.executable, "-m", "shardwise", "rendezvous", "--port", str(port)])
    wait_for([server], r"^shardwise rendezvous: serving", 60)
    return server


def agent(name: str, endpoint: str, args: list[str], *, rdzv_id: str, nproc: int = 2, hosts_store: bool = False,
          max_restarts: int = 3, rdzv_conf: str = RDZV_CONF, extra_env: dict[str, str] | None = None) -> Proc:
    """One node: ``shardwise run --nnodes 1:2`` with the c10d rendezvous at ``endpoint``."""
    cmd = [
        sys.executable,
        "-m",
        "shardwise",
        "run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--max-restarts",
        str(max_restarts),
        "--rdzv-timeout",
        "90",
        "--rdzv-conf",
        f"{rdzv_conf},is_host={int(hosts_store)}",
        *args,
    ]
    return Proc(name, cmd, extra_env=extra_env)


def wait_for(procs: list[Proc], pattern: str, timeout_s: float) -> float:
    """Until a line of one of ``procs`` matches; returns when that line arrived (monotonic)."""
    deadline = time.monotonic() + timeout_s
    regex = re.compile(pattern)
    while time.monotonic() < deadline:
        for p in procs:
            for line, t in zip(list(p.lines), list(p.times)):
                if regex.search(line):
                    return t
        if all(p.proc.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    raise AssertionError(
        f"no line matching {pattern!r}:\n" + "\n".join(f"[{p.name}] {line}" for p in procs for line in p.lines[-60:])
    )


def losses(lines: list[str]) -> dict[int, float]:
    """step -> loss, the last report of each step (a redone step replaces the lost world's)."""
    out = {}
    for line in lines:
        m = LOSS.match(line)
        if m:
            out[int(m.group(1))] = float(m.group(4))
    return out


def first_step_after(procs: list[Proc], t: float, *, world: int) -> tuple[int, float] | None:
    """(step, arrival time) of the first LOSS line of a ``world``-process world after time ``t``."""
    found = []
    for p in procs:
        for line, at in zip(list(p.lines), list(p.times)):
            m = LOSS.match(line)
            if m and at > t and int(m.group(2)) == world:
                found.append((at, int(m.group(1))))
    if not found:
        return None
    at, step = min(found)
    return step, at


def reference(directory: Path, *, steps: int, save_every: int, plan: str = "dp=2,tp=2") -> dict[int, float]:
    """The per-step losses of one uninterrupted process of the same job (the plan re-planned for 1)."""
    done = subprocess.run([sys.executable, *job_args(directory, steps=steps, save_every=save_every, plan=plan)],
                          capture_output=True, text=True, timeout=180, env=env(SHARDWISE_ELASTIC="1:2"), cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    out = losses(done.stdout.splitlines())
    assert sorted(out) == list(range(1, steps + 1)), done.stdout[-2000:]
    return out
