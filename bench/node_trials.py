"""Node-loss trials: two loopback nodes, one of them (the first included) killed or frozen at a random moment.

Each trial starts a ``shardwise rendezvous`` store process and two ``shardwise run`` agents
(``--nnodes 1:2``, 2 processes each, plan ``dp=2,tp=2``, the job of tests/integration/
nodes_harness.py made longer with a short sleep per step), waits a random time (one trial in five
during start-up, 1-8 s after the launch; the others 0-8 s after the first step: steps, saves and
the end of the run), then picks a node at random, the one that started first included, and
either SIGKILLs its agent and workers or SIGSTOPs them and thaws them (SIGCONT) a random 1-15 s
later (shorter than the heartbeat expiry: the node just continues; longer: it was dropped and
must leave). It then checks what the independent check of issue 28 asks:

- every node either finishes with the losses of one uninterrupted run (rtol 1e-5, every step)
  or ends with one clear line (``shardwise run: error: ...``), non-zero;
- no hang: everything has ended 120 s after the event;
- no orphan: no process of either node is alive 10 s after the trial ended.

    python bench/node_trials.py [--trials 12] [--seed 0] [--out bench/results/node_trials.json]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.nodes_harness import (
    Proc,
    agent,
    alive,
    free_port,
    job_args,
    losses,
    reference,
    rendezvous_server,
)  # noqa: E402

STEPS, SAVE_EVERY, STEP_SLEEP = 40, 4, "0.15"
HANG_S = 120.0


def _clear_line(p: Proc) -> str | None:
    """The node's one error line, if its output ends with exactly one (tracebacks excluded)."""
    errors = [line for line in p.lines if line.startswith("shardwise run: error:")]
    tracebacks = [line for line in p.lines if line.startswith("Traceback")]
    return errors[0] if len(errors) == 1 and not tracebacks else None


def trial(work: Path, index: int, rng: random.Random, expected: dict[int, float]) -> dict:
    kind, victim = rng.choice(("kill", "freeze")), rng.choice(("A", "B"))
    during_start = rng.random() < 0.2
    delay, thaw_after = rng.uniform(1.0, 8.0) if during_start else rng.uniform(0.0, 8.0), rng.uniform(1.0, 15.0)
    port, directory = free_port(), work / f"t{index}"
    server = rendezvous_server(port)
    args = job_args(directory, steps=STEPS, save_every=SAVE_EVERY, extra=("--step-sleep", STEP_SLEEP))
    a = agent("A", f"127.0.0.1:{port}", args, rdzv_id=f"trial{index}")
    time.sleep(0.5)
    b = agent("B", f"127.0.0.1:{port}", args, rdzv_id=f"trial{index}")
    nodes = {"A": a, "B": b}
    lost, other = nodes[victim], nodes["B" if victim == "A" else "A"]
    out: dict = {"trial": index, "kind": kind, "victim": victim + (" (started first)" if victim == "A" else ""),
                 "when": f"{delay:.1f} s after the launch" if during_start else f"{delay:.1f} s after the first step"}
    try:
        return _strike(
            out,
            nodes,
            lost,
            other,
            server,
            kind=kind,
            delay=delay,
            during_start=during_start,
            thaw_after=thaw_after,
            expected=expected,
        )
    finally:  # also when interrupted: leave no process behind
        for p in (*nodes.values(), server):
            p.stop()


def _strike(out: dict, nodes: dict[str, Proc], lost: Proc, other: Proc, server: Proc, *, kind: str, delay: float,
            during_start: bool, thaw_after: float, expected: dict[int, float]) -> dict:
    a, b = nodes["A"], nodes["B"]
    start = time.monotonic()
    origin = start if during_start else None  # the first step's arrival, once it came
    while origin is None or time.monotonic() < origin + delay:
        for p in nodes.values():
            p.pids()  # remember every process either node ever had
        if origin is None:
            origin = next(
                (t for p in nodes.values() for line, t in zip(list(p.lines), list(p.times)) if line.startswith("LOSS")),
                None,
            )
            if origin is None and time.monotonic() - start > HANG_S:
                raise RuntimeError("the job did not start training within 120 s")
        time.sleep(0.05)
    steps_before = max(losses(a.lines + b.lines), default=0)
    out["steps_done_at_event"] = steps_before
    event = time.monotonic()
    if kind == "kill":
        lost.kill()
    else:
        lost.signal_all(signal.SIGSTOP)
        while time.monotonic() - event < thaw_after:
            other.pids()
            time.sleep(0.1)
        lost.signal_all(signal.SIGCONT)
        out["thawed_after_s"] = round(thaw_after, 2)
    hang = False
    for p in nodes.values():
        while p.proc.poll() is None and time.monotonic() - event < HANG_S:
            p.pids()
            time.sleep(0.1)
        if p.proc.poll() is None:
            hang = True
    out["hang"] = hang
    for p in nodes.values():
        p.stop()
    server.stop()
    gone_by = time.monotonic() + 10
    while time.monotonic() < gone_by and any(alive(pid) for p in nodes.values() for pid in p.seen):
        time.sleep(0.2)
    out["orphans"] = [pid for p in nodes.values() for pid in p.seen if alive(pid)]
    got = losses(lost.lines) | losses(other.lines)  # the survivor's report of a redone step wins
    out["losses_match"] = sorted(got) == sorted(expected) and all(
        abs(got[s] - expected[s]) <= 1e-5 * abs(expected[s]) for s in expected
    )
    for name, p in nodes.items():
        rc = p.proc.returncode
        line = _clear_line(p)
        killed = p is lost and kind == "kill"
        out[f"{name}_rc"] = rc
        out[f"{name}_line"] = line
        out[f"{name}_ok"] = killed or (rc == 0 and out["losses_match"]) or (rc not in (0, None) and line is not None)
    out["as_expected"] = not hang and not out["orphans"] and out["A_ok"] and out["B_ok"]
    out["seconds"] = round(time.monotonic() - start, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="node-trials-") as tmp:
        work = Path(tmp)
        expected = reference(work / "reference", steps=STEPS, save_every=SAVE_EVERY)
        for i in range(args.trials):
            r = trial(work, i, rng, expected)
            results.append(r)
            lines = "; ".join(
                f"{n}: exit {r[n + '_rc']}" + (f" {r[n + '_line'][:90]!r}" if r[n + "_line"] else "") for n in "AB"
            )
            print(
                f"trial {i:2d} {r['kind']:6s} {r['victim']:18s} {r['when']:28s} (step {r['steps_done_at_event']:2d} "
                f"done): {lines}; losses match {r['losses_match']}, orphans {len(r['orphans'])}, hang {r['hang']}"
                f"{'' if r['as_expected'] else '  <-- UNEXPECTED'}",
                flush=True,
            )
    print(f"{sum(r['as_expected'] for r in results)} of {len(results)} trials as documented; "
          f"{sum(len(r['orphans']) for r in results)} orphans, {sum(r['hang'] for r in results)} hangs")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(
                {"command": "python bench/node_trials.py " + " ".join(sys.argv[1:]), "trials": results}, fh, indent=1
            )


if __name__ == "__main__":
    main()
