"""The cost of losing a node: seconds from the loss to the first step of the new world, and steps redone.

Two loopback "nodes" (two ``shardwise run`` agents, ``--nnodes 1:2``, both clients of a
``shardwise rendezvous`` store process) train the node-loss job of the tests
(tests/integration/nodes_harness.py: a small MLP, a checkpoint every 4 steps). In step 7 (while
every rank waits in a hold inside the step) one node is lost:

- ``killed``: the second node's agent and workers are SIGKILLed;
- ``frozen``: the second node's agent and workers are SIGSTOPped (thawed once the new world
  trains; it must exit with its one line);
- ``killed-first``: the node that started first is SIGKILLed.

For each plan (``dp=2``: 2 nodes x 1 process; ``dp=2,tp=2``: 2 nodes x 2 processes) and each
event it records the seconds from the event to the line that names the lost node, to the new
world's rendezvous (``elastic: the world re-formed``), to the survivor's first step in the new
world, and the steps redone (from the log's ``elastic:`` line).
Repeats are interleaved; the JSON holds every trial and the medians.

The rendezvous settings are the tests' fast ones by default (a node is lost after 1 s x 5
heartbeats, a short world waits 3 s for more nodes); ``--defaults`` uses torch's (5 s x 3, 30 s),
what a job gets without ``--rdzv-conf``.

    python bench/node_loss_cost.py [--repeats 2] [--defaults] [--out bench/results/node_loss_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.nodes_harness import (RDZV_CONF, SAVE_EVERY, STEPS, agent, first_step_after, free_port, job_args,  # noqa: E402
                                             losses, reference, rendezvous_server, wait_for)

EVENT_AT = 6
PLANS = {"dp=2": 1, "dp=2,tp=2": 2}  # plan -> processes per node
EVENTS = ("killed", "frozen", "killed-first")
DEFAULT_CONF = "last_call_timeout=30,keep_alive_interval=5,keep_alive_max_attempt=3"  # torch's defaults, spelled out


def trial(work: Path, *, plan: str, nproc: int, event: str, conf: str, expected: dict[int, float]) -> dict:
    directory = work / f"{plan.replace(',', '_').replace('=', '')}-{event}-{time.monotonic_ns()}"
    port = free_port()
    server = rendezvous_server(port)
    world = 2 * nproc
    args = job_args(
        directory, steps=STEPS, save_every=SAVE_EVERY, plan=plan, extra=("--hold-at", f"{EVENT_AT}:{world}")
    )
    a = agent("A", f"127.0.0.1:{port}", args, rdzv_id="cost", nproc=nproc, rdzv_conf=conf)
    time.sleep(0.5)
    b = agent("B", f"127.0.0.1:{port}", args, rdzv_id="cost", nproc=nproc, rdzv_conf=conf)
    lost, survivor = (a, b) if event == "killed-first" else (b, a)
    out: dict = {"plan": plan, "processes": world, "event": event, "load_avg_1min": round(os.getloadavg()[0], 1)}
    try:
        wait_for([a, b], rf"^HOLD step={EVENT_AT} world={world}$", 180)
        at = time.monotonic()
        if event == "frozen":
            lost.signal_all(signal.SIGSTOP)
        else:
            lost.kill()
        deadline = at + 180
        first = None
        while first is None and time.monotonic() < deadline and survivor.proc.poll() is None:
            first = first_step_after([survivor], at, world=nproc)
            time.sleep(0.05)
        out["to_first_step_s"] = round(first[1] - at, 2) if first else None
        named = [t for line, t in zip(survivor.lines, survivor.times) if "sent no heartbeat" in line]
        out["named_after_s"] = round(named[0] - at, 2) if named else None
        reformed = [
            t
            for line, t in zip(survivor.lines, survivor.times)
            if line.startswith("elastic: the world re-formed") and t > at
        ]
        out["reformed_after_s"] = round(reformed[0] - at, 2) if reformed else None
        if event == "frozen":
            lost.signal_all(signal.SIGCONT)
            out["thawed_rc"] = lost.proc.wait(timeout=60)
            out["thawed_line"] = next((line for line in lost.lines if "shardwise run: error:" in line), None)
        out["survivor_rc"] = survivor.proc.wait(timeout=240)
    finally:
        for p in (a, b, server):
            p.stop()
    text = "\n".join(survivor.lines)
    m = re.search(
        r"^elastic: resumed from the checkpoint of step (\d+); (no steps are redone|step \d+ is redone|steps "
        r"(\d+)-(\d+) are redone)",
        text,
        re.M,
    )
    out["resumed_from"] = int(m.group(1)) if m else None
    out["steps_redone"] = (0 if m.group(2).startswith("no") else 1 if m.group(2).startswith("step ") else
                           int(m.group(4)) - int(m.group(3)) + 1) if m else None
    got = losses(a.lines + b.lines) | losses(survivor.lines)  # the survivor's report of a redone step wins
    out["losses_match"] = sorted(got) == sorted(expected) and all(
        abs(got[s] - expected[s]) <= 1e-5 * abs(expected[s]) for s in expected
    )
    out["orphans"] = len(a.orphans() + b.orphans())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--defaults", action="store_true", help="torch's rendezvous defaults instead of the tests' fast ones"
    )
    p.add_argument("--plan", action="append", choices=list(PLANS), help="only this plan (repeatable; default: both)")
    p.add_argument("--events", default=",".join(EVENTS))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    conf = DEFAULT_CONF if args.defaults else RDZV_CONF
    plans = args.plan or list(PLANS)
    events = [e for e in EVENTS if e in args.events.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="node-loss-cost-") as tmp:
        work = Path(tmp)
        expected = {
            plan: reference(work / f"ref-{PLANS[plan]}", steps=STEPS, save_every=SAVE_EVERY, plan=plan)
            for plan in plans
        }
        for r in range(args.repeats):  # interleaved: every (plan, event) once per round
            for plan in plans:
                for event in events:
                    row = trial(work, plan=plan, nproc=PLANS[plan], event=event, conf=conf, expected=expected[plan])
                    row["repeat"] = r
                    results.append(row)
                    print(json.dumps(row), flush=True)
    summary = []
    for plan in plans:
        for event in events:
            rows = [x for x in results if x["plan"] == plan and x["event"] == event]
            firsts = [x["to_first_step_s"] for x in rows if x["to_first_step_s"] is not None]
            named = [x["named_after_s"] for x in rows if x["named_after_s"] is not None]
            reformed = [x["reformed_after_s"] for x in rows if x["reformed_after_s"] is not None]
            summary.append({"plan": plan, "processes": 2 * PLANS[plan], "event": event, "trials": len(rows),
                            "median_to_first_step_s": statistics.median(firsts) if firsts else None,
                            "median_named_after_s": statistics.median(named) if named else None,
                            "median_reformed_after_s": statistics.median(reformed) if reformed else None,
                            "steps_redone": sorted({x["steps_redone"] for x in rows}, key=str),
                            "all_losses_match": all(x["losses_match"] for x in rows),
                            "orphans": sum(x["orphans"] for x in rows)})
    for s in summary:
        print(
            f"{s['plan']:10s} {s['processes']} procs  {s['event']:12s}  named after {s['median_named_after_s']} s, "
            f"world re-formed after {s['median_reformed_after_s']} s, first step of the new world after "
            f"{s['median_to_first_step_s']} s (median of {s['trials']}), "
            f"steps redone {s['steps_redone']}, losses match: {s['all_losses_match']}, orphans {s['orphans']}"
        )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"command": "python bench/node_loss_cost.py " + " ".join(sys.argv[1:]), "rdzv_conf": conf,
                       "checkpoint_every": SAVE_EVERY, "lost_in_step": EVENT_AT + 1, "cpu_count": os.cpu_count(),
                       "summary": summary, "trials": results}, fh, indent=1)


if __name__ == "__main__":
    main()
