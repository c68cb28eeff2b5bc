"""Keep training when a node is lost, grow again when it comes back (real processes, loopback).

Two "nodes" are two ``shardwise run`` agents on this machine, 2 processes each, with the c10d
rendezvous and ``--nnodes 1:2``; node A hosts the rendezvous store. The job trains a small MLP
with the Trainer under plan ``dp=2,tp=2`` and checkpoints every 4 steps:

1. in step 10 node B's agent and workers are SIGKILLed; A's workers fail on the broken
   collective, A's agent re-forms the world alone, the Trainer re-plans ``dp=2,tp=2`` -> ``tp=2``
   for 2 processes, reshards the step-8 checkpoint with the exact data position and redoes step 9;
2. in step 17 a new agent joins as node B: A's workers get SIGTERM, save at the end of that step
   and stop; the world of 4 re-forms and resumes with no step redone.

Both events happen while the ranks wait in a hold of the job script (``--hold-at``), so the test
acts at a known step instead of racing a running job.

The per-step losses (the last value of each step) match one uninterrupted process of the same
job within rtol 1e-5: every world sees the same global batches, only float32 rounding differs.
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

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "elastic_train.py"
REPO = Path(__file__).resolve().parents[2]
STEPS, SAVE_EVERY, KILL_AT, HOLD_AT = 24, 4, 9, 16
# Fast rendezvous for a test: a dead node is noticed after 1 s x 5 missed heartbeats, and a world
# short of its maximum waits 3 s for more nodes. Much shorter heartbeats risk a loaded machine
# declaring a live node dead (a split world); keep torch's defaults (5 s x 3, 30 s) in production.
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


def _job_args(directory: Path, *extra: str) -> list[str]:
    return [str(SCRIPT), "--dir", str(directory), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra]


class Agent:
    """One ``shardwise run`` node, its output collected line by line."""

    def __init__(self, name: str, port: int, directory: Path, *, hosts_store: bool) -> None:
        self.name, self.lines = name, []
        cmd = [sys.executable, "-m", "shardwise", "run", "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "node-loss-test", "--max-restarts", "3", "--rdzv-timeout", "90",
               "--rdzv-conf", f"{RDZV_CONF},is_host={int(hosts_store)}",
               *_job_args(directory, "--hold-at", f"{KILL_AT}:4", "--hold-at", f"{HOLD_AT}:2")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))

    def tree(self) -> list[int]:
        """The agent and every process below it (its workers lead their own sessions)."""
        pids, frontier = [], [self.proc.pid]
        while frontier:
            pid = frontier.pop()
            pids.append(pid)
            for entry in os.listdir("/proc"):
                try:
                    if entry.isdigit() and int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                        frontier.append(int(entry))
                except (OSError, IndexError):
                    continue
        return pids

    def kill(self) -> None:
        for pid in self.tree():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        self._reader.join(timeout=10)


def _wait_for(agents: list[Agent], pattern: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(re.search(pattern, line) for a in agents for line in list(a.lines)):
            return
        if all(a.proc.poll() is not None for a in agents):
            break
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(f"[{a.name}] {l}" for a in agents for l in a.lines[-60:]))


def _losses(lines: list[str]) -> dict[int, float]:
    """step -> loss, the last report of each step (a redone step replaces the lost world's)."""
    out = {}
    for line in lines:
        m = re.match(r"LOSS step=(\d+) world=(\d+) plan=(\S+) loss=(\S+)", line)
        if m:
            out[int(m.group(1))] = float(m.group(4))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_node_lost_then_regained_keeps_the_losses_of_one_uninterrupted_run(tmp_path: Path) -> None:
    env = dict(_env(), SHARDWISE_ELASTIC="1:2")  # the same plan string, re-planned for one process
    reference = subprocess.run([sys.executable, *_job_args(tmp_path / "reference")], capture_output=True, text=True,
                               timeout=180, env=env, cwd=REPO)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _losses(reference.stdout.splitlines())
    assert sorted(expected) == list(range(1, STEPS + 1))

    port, directory = _free_port(), tmp_path / "elastic"
    a = Agent("A", port, directory, hosts_store=True)
    time.sleep(0.5)  # A binds the rendezvous store first
    b = Agent("B", port, directory, hosts_store=False)
    agents = [a, b]
    try:
        _wait_for(agents, rf"^HOLD step={KILL_AT} world=4$", 180)
        b.kill()  # node B is lost: agent and workers, no goodbye
        _wait_for([a], rf"^HOLD step={HOLD_AT} world=2$", 180)
        b2 = Agent("B2", port, directory, hosts_store=False)  # the node comes back
        agents.append(b2)
        assert a.proc.wait(timeout=240) == 0, "\n".join(a.lines[-80:])
        assert b2.proc.wait(timeout=60) == 0, "\n".join(b2.lines[-80:])
    finally:
        for agent in agents:
            if agent.proc.poll() is None:
                agent.kill()
    lines = a.lines + b2.lines
    text = "\n".join(lines)

    # the world: 4 processes, then 2 re-planned to tp=2, then 4 again
    worlds = [(int(s), int(w), p) for s, w, p in re.findall(r"^LOSS step=(\d+) world=(\d+) plan=(\S+)", text, re.M)]
    assert {(w, p) for _, w, p in worlds} == {(4, "dp=2,tp=2"), (2, "dp=1,tp=2")}, text
    assert any(w == 2 for s, w, _ in worlds if s > KILL_AT) and any(w == 4 for s, w, _ in worlds if s > HOLD_AT)

    # the log says who was lost, the old and new plan, and the steps redone
    lost = re.search(r"^elastic: lost 1 node after step (\d+): \S+ \(agent pid \d+, ranks 2-3\); 2 processes remain on 1 node$", text, re.M)
    assert lost, text
    last_before_loss = int(lost.group(1))
    assert re.search(r"^elastic: plan dp=2,tp=2 \(4 processes\) -> dp=1,tp=2 \(2 processes\); global batch 8 kept", text, re.M), text
    resumed = int(re.search(r"^checkpoint: resumed from step (\d+)", text, re.M).group(1))
    assert resumed % SAVE_EVERY == 0 and resumed <= last_before_loss
    redone = {0: "no steps are redone", 1: f"step {last_before_loss} is redone"}.get(
        last_before_loss - resumed, f"steps {resumed + 1}-{last_before_loss} are redone")
    assert f"elastic: resumed from the checkpoint of step {resumed}; {redone}" in lines, text
    assert last_before_loss == KILL_AT and resumed == KILL_AT // SAVE_EVERY * SAVE_EVERY, text
    assert re.search(rf"^elastic: 1 node joined after step {HOLD_AT + 1}: .*; 4 processes on 2 nodes$", text, re.M), text
    assert re.search(rf"^elastic: resumed from the checkpoint of step {HOLD_AT + 1}; no steps are redone$", text, re.M), text

    # the same losses as one uninterrupted process, step by step
    got = _losses(lines)
    assert sorted(got) == list(range(1, STEPS + 1)), text
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (step, got[step], expected[step])
