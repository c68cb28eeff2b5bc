"""No node is special: the rendezvous store lives on a host that does not train, so the node that
started first may be lost; and a node that goes silent (frozen: SIGSTOP of its agent and workers
in the middle of a step) is noticed from the agents' heartbeat, not from a timeout.

Two "nodes" are two ``shardwise run`` agents on this machine, 2 processes each, ``--nnodes 1:2``,
both clients of a ``shardwise rendezvous`` process (the store host). The job is
``scripts/elastic_train.py`` under plan ``dp=2,tp=2``, a checkpoint every 4 steps; each event
happens while the ranks wait in a hold inside a step (``--hold-at``), so the test acts at a known
step. In both tests the per-step losses match one uninterrupted process within rtol 1e-5.

Each test takes about 25-30 s on an idle 2-core machine, more than the suite's usual 30 s: the
workers start twice (before and after the loss) and the frozen node is noticed only after the
heartbeat expiry (5 s here); the reference run is shared (the ``elastic_reference`` fixture). The
agents are new interpreters; the workers of a node that is lost (SIGKILL) fork from the session's
fork server (they die with their stand-ins in the agent's tree; each worker seen must be gone at
the end), those of the frozen node are new interpreters in its tree (``fresh_workers``).
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from shardwise.checkpoint import commit as cm
from tests.integration.nodes_harness import (
    SAVE_EVERY,
    STEPS,
    Proc,
    agent,
    first_step_after,
    free_port,
    job_args,
    losses,
    rendezvous_server,
    wait_for,
)

EVENT_AT = 6
EXPIRY_S = 5  # RDZV_CONF: keep_alive_interval=1 x keep_alive_max_attempt=5


@pytest.fixture
def expected(elastic_reference: dict[int, float]) -> dict[int, float]:
    return elastic_reference


def _nodes(directory: Path, rdzv_id: str) -> tuple[Proc, Proc, Proc]:
    port = free_port()
    server = rendezvous_server(port)
    args = job_args(directory, steps=STEPS, save_every=SAVE_EVERY, extra=("--hold-at", f"{EVENT_AT}:4"))
    a = agent("A", f"127.0.0.1:{port}", args, rdzv_id=rdzv_id)
    time.sleep(0.5)  # A is the node that started first
    b = agent("B", f"127.0.0.1:{port}", args, rdzv_id=rdzv_id)
    return server, a, b


def _assert_losses(lines: list[str], expected: dict[int, float]) -> None:
    got = losses(lines)
    assert sorted(got) == list(range(1, STEPS + 1)), "\n".join(lines)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (step, got[step], expected[step])


def _assert_resumed(text: str, *, lost_after: int) -> None:
    resumed = EVENT_AT // SAVE_EVERY * SAVE_EVERY
    assert re.search(
        rf"^elastic: lost 1 node after step {lost_after}: \S+ \(agent pid \d+, ranks \d-\d\); 2 processes remain on 1 "
        r"node$",
        text,
        re.M,
    ), text
    assert re.search(
        r"^elastic: plan dp=2,tp=2 \(4 processes\) -> dp=1,tp=2 \(2 processes\); global batch 8 kept", text, re.M
    ), text
    assert (
        f"elastic: resumed from the checkpoint of step {resumed}; steps {resumed + 1}-{lost_after} are redone" in text
    ), text


def _assert_checkpoints_intact(directory: Path) -> None:
    committed = [p for p in sorted(directory.glob("step_*")) if (p / cm.MARKER).exists()]
    assert committed, list(directory.iterdir())
    for path in committed:  # every committed checkpoint still verifies, checksums included
        marker, why = cm.verify(str(path), level="checksum")
        assert marker is not None, (path, why)


@pytest.mark.slow
@pytest.mark.timeout(300)  # about 30 s idle; a loaded machine (40 runnable processes) took 111 s
def test_losing_the_node_that_started_first_keeps_the_job(tmp_path: Path, expected: dict[int, float]) -> None:
    directory = tmp_path / "ckpt"
    server, a, b = _nodes(directory, "first-node-loss")
    try:
        wait_for([a, b], rf"^HOLD step={EVENT_AT} world=4$", 120)
        a.kill()  # the first node, where torch's c10d rendezvous would have kept its store
        assert b.proc.wait(timeout=120) == 0, "\n".join(b.lines[-80:])
    finally:
        for p in (a, b, server):
            p.stop()
    text = "\n".join(b.lines)
    assert re.search(r"^LOSS step=\d+ world=2 plan=dp=1,tp=2 ", text, re.M), text
    _assert_resumed(text, lost_after=EVENT_AT)
    _assert_losses(a.lines + b.lines, expected)
    _assert_checkpoints_intact(directory)
    assert not a.orphans() and not b.orphans()


@pytest.mark.slow
@pytest.mark.timeout(300)  # about 30 s idle; a loaded machine (40 runnable processes) took 111 s
@pytest.mark.fresh_workers  # the node is frozen (SIGSTOP) as a process tree: its workers must be in it
def test_frozen_node_is_dropped_within_seconds_and_exits_when_thawed(
    tmp_path: Path, expected: dict[int, float]
) -> None:
    directory = tmp_path / "ckpt"
    server, a, b = _nodes(directory, "frozen-node")
    try:
        wait_for([a, b], rf"^HOLD step={EVENT_AT} world=4$", 120)
        frozen = b.signal_all(signal.SIGSTOP)  # agent and workers, in the middle of step 7
        frozen_at = time.monotonic()
        noticed = wait_for([a], r"^elastic: node \d \(\S+, agent pid \d+\) sent no heartbeat for \d+ s: it is lost", 60)
        step, first = first_step_after([a], frozen_at, world=2) or (None, None)
        while step is None and a.proc.poll() is None and time.monotonic() - frozen_at < 60:
            time.sleep(0.1)
            step, first = first_step_after([a], frozen_at, world=2) or (None, None)
        assert first is not None, "\n".join(a.lines[-80:])
        b.signal_all(signal.SIGCONT)  # the node thaws while the others train without it
        assert b.proc.wait(timeout=30) != 0, "\n".join(b.lines[-40:])
        assert a.proc.wait(timeout=120) == 0, "\n".join(a.lines[-80:])
    finally:
        for p in (a, b, server):
            p.stop()
    text = "\n".join(a.lines)
    assert noticed - frozen_at < EXPIRY_S + 3, (noticed - frozen_at, text)
    assert first - frozen_at < 60, (first - frozen_at, text)
    assert f"agent pid {frozen[0]}" in next(line for line in a.lines if "sent no heartbeat" in line)
    _assert_resumed(text, lost_after=EVENT_AT)
    # the thawed node finds the world gone: one line, its workers killed, nothing written since
    last = [line for line in b.lines if "shardwise run: error:" in line]
    assert len(last) == 1 and "was dropped from the job while it ran" in last[0], "\n".join(b.lines[-30:])
    _assert_losses(a.lines, expected)
    _assert_checkpoints_intact(directory)
    assert not a.orphans() and not b.orphans(), (a.orphans(), b.orphans())
