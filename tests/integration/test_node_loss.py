"""Keep training when a node is lost, grow again when it comes back (real processes, loopback).

Two "nodes" are two ``shardwise run`` agents on this machine, 2 processes each, with the c10d
rendezvous and ``--nnodes 1:2``; here node A hosts the rendezvous store the way torchrun does
(``is_host=1``; tests/integration/test_node_silent.py covers a store off the nodes). The job
(tests/integration/nodes_harness.py) trains a small MLP with the Trainer under plan
``dp=2,tp=2`` and checkpoints every 4 steps:

1. in step 7 node B's agent and workers are SIGKILLed; A's workers fail on the broken
   collective, A's agent re-forms the world alone, the Trainer re-plans ``dp=2,tp=2`` -> ``tp=2``
   for 2 processes, reshards the step-4 checkpoint with the exact data position and redoes 5-6;
2. in step 11 a new agent joins as node B: A's workers get SIGTERM, save at the end of that step
   and stop; the world of 4 re-forms and resumes with no step redone.

Both events happen while the ranks wait in a hold of the job script (``--hold-at``), so the test
acts at a known step instead of racing a running job.

The per-step losses (the last value of each step) match one uninterrupted process of the same
job within rtol 1e-5: every world sees the same global batches, only float32 rounding differs.
About 25-30 s on an idle 2-core machine (three worlds start; the reference run is shared).

The agents are new interpreters; their workers fork from the session's fork server (a killed node's
workers die with their stand-ins, which are in the agent's tree, and the test checks that every
worker it saw is gone at the end).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.integration.nodes_harness import SAVE_EVERY, STEPS, agent, free_port, job_args, losses, wait_for

KILL_AT, HOLD_AT = 6, 10


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_node_lost_then_regained_keeps_the_losses_of_one_uninterrupted_run(
    tmp_path: Path, elastic_reference: dict[int, float]
) -> None:
    port, directory = free_port(), tmp_path / "elastic"
    args = job_args(
        directory, steps=STEPS, save_every=SAVE_EVERY, extra=("--hold-at", f"{KILL_AT}:4", "--hold-at", f"{HOLD_AT}:2")
    )
    a = agent("A", f"127.0.0.1:{port}", args, rdzv_id="node-loss-test", hosts_store=True)
    time.sleep(0.5)  # A binds the rendezvous store first
    b = agent("B", f"127.0.0.1:{port}", args, rdzv_id="node-loss-test")
    agents = [a, b]
    try:
        wait_for(agents, rf"^HOLD step={KILL_AT} world=4$", 120)
        b.kill()  # node B is lost: agent and workers, no goodbye
        wait_for([a], rf"^HOLD step={HOLD_AT} world=2$", 120)
        b2 = agent("B2", f"127.0.0.1:{port}", args, rdzv_id="node-loss-test")  # the node comes back
        agents.append(b2)
        assert a.proc.wait(timeout=150) == 0, "\n".join(a.lines[-80:])
        assert b2.proc.wait(timeout=60) == 0, "\n".join(b2.lines[-80:])
    finally:
        for p in agents:
            p.stop()
    lines = a.lines + b2.lines
    text = "\n".join(lines)

    # the world: 4 processes, then 2 re-planned to tp=2, then 4 again
    worlds = [(int(s), int(w), p) for s, w, p in re.findall(r"^LOSS step=(\d+) world=(\d+) plan=(\S+)", text, re.M)]
    assert {(w, p) for _, w, p in worlds} == {(4, "dp=2,tp=2"), (2, "dp=1,tp=2")}, text
    assert any(w == 2 for s, w, _ in worlds if s > KILL_AT) and any(w == 4 for s, w, _ in worlds if s > HOLD_AT)

    # the log says who was lost, the old and new plan, and the steps redone
    lost = re.search(
        r"^elastic: lost 1 node after step (\d+): \S+ \(agent pid \d+, ranks 2-3\); 2 processes remain on 1 node$",
        text,
        re.M,
    )
    assert lost, text
    last_before_loss = int(lost.group(1))
    assert re.search(
        r"^elastic: plan dp=2,tp=2 \(4 processes\) -> dp=1,tp=2 \(2 processes\); global batch 8 kept", text, re.M
    ), text
    resumed = int(re.search(r"^checkpoint: resumed from step (\d+)", text, re.M).group(1))
    assert resumed % SAVE_EVERY == 0 and resumed <= last_before_loss
    redone = {0: "no steps are redone", 1: f"step {last_before_loss} is redone"}.get(
        last_before_loss - resumed, f"steps {resumed + 1}-{last_before_loss} are redone")
    assert f"elastic: resumed from the checkpoint of step {resumed}; {redone}" in lines, text
    assert last_before_loss == KILL_AT and resumed == KILL_AT // SAVE_EVERY * SAVE_EVERY, text
    assert re.search(rf"^elastic: 1 node joined after step {HOLD_AT + 1}: .*; 4 processes on 2 nodes$", text, re.M), (
        text
    )
    assert re.search(
        rf"^elastic: resumed from the checkpoint of step {HOLD_AT + 1}; no steps are redone$", text, re.M
    ), text

    # the same losses as one uninterrupted process, step by step
    got = losses(lines)
    assert sorted(got) == list(range(1, STEPS + 1)), text
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(elastic_reference[step], rel=1e-5), (step, got[step], elastic_reference[step])
    assert not any(p.orphans() for p in agents)
