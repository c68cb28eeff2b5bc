"""Pre-emption trials: ``shardwise train`` on 2 processes, hit by a signal at a random moment.

Each trial starts a run, waits a random time (start-up included, so some signals land before
training), sends one of the signals a scheduler or an operator sends, and then checks:

- no process of the run is left 60 s after the signal (no orphans);
- nothing hung (the whole trial has a hard timeout; the watchdog's ``HANG`` never appears);
- the exit status is the documented one (143 SIGTERM, 138 SIGUSR1, or 0 when the run had
  already finished);
- when the run says it was pre-empted, the line names the step and a complete checkpoint there.

    python bench/preemption_trials.py [--trials 15] [--seed 0] [--out bench/results/preemption_trials.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

from shardwise.checkpoint import commit as cm
from shardwise.launch.forward import child_pids

ARGS = ["--nproc", "2", "--max-steps", "300", "--checkpoint.every_n_steps=50", "--model.layers=1", "--model.hidden=32",
        "--model.heads=2", "--model.seq_len=32", "--data.max_chars=20000", "--train.global_batch_size=8",
        "--train.log_every=1", "--sample.chars=0", "--hang-timeout", "60"]
KINDS = ("term-launcher", "usr1-all", "usr1-launcher", "term-worker", "kill-launcher")
LINE = re.compile(r"pre-empted by (SIG\w+) at step (\d+) of \d+: checkpoint saved at (\S+); resume with: (.+)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def trial(cwd: str, index: int, kind: str, delay: float) -> dict:
    name = f"t{index}"
    cmd = [sys.executable, "-m", "shardwise", "train", f"--run.name={name}", *ARGS]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with open(os.path.join(cwd, f"{name}.out"), "w") as out, open(os.path.join(cwd, f"{name}.err"), "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True)
    seen: set[int] = set()
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline and proc.poll() is None:
        seen.update(child_pids(proc.pid))
        time.sleep(0.05)
    workers = child_pids(proc.pid)
    while kind == "term-worker" and len(workers) < 2 and proc.poll() is None:  # a worker must be there to signal
        time.sleep(0.05)
        workers = child_pids(proc.pid)
    seen.update(workers)
    if kind == "term-launcher":
        proc.send_signal(signal.SIGTERM)
    elif kind == "usr1-launcher":
        proc.send_signal(signal.SIGUSR1)
    elif kind == "usr1-all":
        for pid in (proc.pid, *workers):
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    elif kind == "term-worker" and workers:
        os.kill(workers[-1], signal.SIGTERM)
    elif kind == "kill-launcher":
        proc.send_signal(signal.SIGKILL)
    sent = time.monotonic()
    try:
        rc = proc.wait(300)
    except subprocess.TimeoutExpired:
        rc = None
    while any(_alive(p) for p in seen) and time.monotonic() - sent < 60:
        time.sleep(0.2)
    orphans = [p for p in seen if _alive(p)]
    for p in orphans + ([proc.pid] if rc is None else []):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = open(os.path.join(cwd, f"{name}.out")).read()
    errors = open(os.path.join(cwd, f"{name}.err")).read()
    match = LINE.search(text)
    checkpoint_ok = None
    if match:
        checkpoint_ok = cm.verify(match.group(3))[0] is not None and match.group(3).endswith(
            cm.step_dirname(int(match.group(2)))
        )
    return {
        "trial": index,
        "kind": kind,
        "delay_s": round(delay, 2),
        "rc": rc,
        "workers_seen": len(seen),
        "orphans": orphans,
        "hang": rc is None or "HANG" in errors,
        "preempted_line": match.group(0) if match else None,
        "checkpoint_ok": checkpoint_ok,
        "gone_after_s": round(time.monotonic() - sent, 1),
        "last_stderr": errors.strip().splitlines()[-1] if errors.strip() else "",
    }


def expected(r: dict) -> bool:
    """The documented outcome: no orphans, no hang, a pre-emption line only with its complete
    checkpoint, and the exit status of the signal (0 if the run had already finished)."""
    if r["orphans"] or r["hang"] or (r["preempted_line"] and not r["checkpoint_ok"]):
        return False
    if r["kind"] == "kill-launcher":
        return r["rc"] == -signal.SIGKILL
    sig = signal.SIGUSR1 if r["kind"].startswith("usr1") else signal.SIGTERM
    if not r["workers_seen"]:  # the command was still starting (the signal's default action), or it
        return r["rc"] in (-sig, 128 + sig, 0)  # recorded the signal and then the run finished
    if r["preempted_line"]:
        return r["rc"] == 128 + sig
    if r["kind"] == "term-worker" and r["rc"] == 1:  # the worker was still importing torch: a failure
        return "SIGTERM" in r["last_stderr"]
    return r["rc"] in (0, 128 + sig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--keep", default=None, metavar="DIR", help="run in DIR and keep every trial's output there")
    args = p.parse_args()
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="preempt-trials-") as tmp:
        cwd = args.keep or tmp
        os.makedirs(cwd, exist_ok=True)
        for i in range(args.trials):
            kind = KINDS[i % len(KINDS)]
            r = trial(cwd, i, kind, rng.uniform(2.0, 25.0))
            r["as_expected"] = expected(r)
            results.append(r)
            print(f"trial {i:2d} {kind:14s} after {r['delay_s']:5.1f} s: exit {r['rc']}, orphans {len(r['orphans'])}, "
                  f"hang {r['hang']}, gone {r['gone_after_s']} s, {r['preempted_line'] or r['last_stderr'][:110]!r}"
                  f"{'' if r['as_expected'] else '  <-- UNEXPECTED'}", flush=True)
    print(f"{sum(r['as_expected'] for r in results)} of {len(results)} trials as documented; "
          f"{sum(len(r['orphans']) for r in results)} orphans, {sum(r['hang'] for r in results)} hangs")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
