"""What a failure costs with fault-tolerant replica groups (``shardwise run --ft-replicas``,
torchft), beside today's elastic restart (bench/node_loss_cost.py).

Each trial starts R replica groups (R = 2 or 3) of one process on loopback, training the tests'
job (tests/integration/scripts/ft_train.py: a token MLP, ragged masks, AdamW, a step schedule,
``--max-restarts 1``; each step waits ``--sleep`` s after its backward, so a kill at a random moment
most often finds the other groups inside their gradient all-reduce, i.e. mid-step). Once every
group has committed a random step in 4..8, a random group's worker is SIGKILLed at a random moment
in the next step. Recorded per trial:

- ``to_next_commit_s``: from the kill to the survivors' next committed step (their ``STEP`` line);
- ``discarded_steps``, ``healed_replicas``, ``seconds_lost``: from the job's summary.json;
- ``back_s``: from the kill to the killed group's first committed step after its restart (restart +
  heal); ``heal_s``: the heal itself (quorum with the state transfer);
- ``survivor_restarted``: whether a survivor's process changed (it must not);
- ``steps_redone``: committed steps a survivor ran again (its step numbers never go back: 0);
- ``weights_equal``: the groups' final weights bitwise equal.

The elastic figures come from bench/results/node_loss_cost.json (same loopback machine; a node is
lost, the world re-forms and resumes from the newest checkpoint).

    python bench/ft_trials.py [--trials 4] [--heartbeat 5] [--out bench/results/ft_trials.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration import ft_harness as h  # noqa: E402

STEPS = 80


def trial(work: Path, *, replicas: int, rng: random.Random, sleep_s: float, heartbeat_s: float) -> dict:
    job = h.start(work, replicas=replicas, nproc=1, plan="dp", steps=STEPS, sleep_s=sleep_s, max_restarts=1,
                  env={"FT_GLOBAL_BATCH": str(4 * replicas)}, extra=["--ft-heartbeat-timeout", f"{heartbeat_s:g}"])
    at = rng.randint(4, 8)
    try:
        for r in range(replicas):
            job.wait_for(r, at, 240)
        victim = rng.randrange(replicas)
        pid = [s for s in job.steps if s.replica == victim][-1].pid
        time.sleep(rng.uniform(0.0, sleep_s))
        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        code = job.finish(300)
    finally:
        job.kill()
    survivors = [s for s in job.steps if s.replica != victim]
    after = [s.t - killed for s in survivors if s.t > killed]
    back = [s.t - killed for s in job.steps if s.replica == victim and s.pid != pid and s.t > killed]
    summary = h.summarize_file(job)
    events = h.read_events(job.ft_dir)
    heals = [e["heal_s"] for e in events if e["event"] == "healed" and e["replica"] == victim and e["t"] > killed]
    final = h.results(job)
    import torch

    first = final[0]["weights"]
    equal = len(final) == replicas and all(
        torch.equal(first[k], f["weights"][k]) for f in final.values() for k in first
    )
    redone = sum(
        max(0, a.step - b.step + 1)
        for r in range(replicas)
        if r != victim
        for a, b in zip([s for s in survivors if s.replica == r], [s for s in survivors if s.replica == r][1:])
    )
    return {
        "replicas": replicas,
        "victim": victim,
        "killed_in_step": at + 1,
        "exit_code": code,
        "to_next_commit_s": round(min(after), 3) if after else None,
        "back_s": round(min(back), 3) if back else None,
        "heal_s": heals[0] if heals else None,
        "discarded_steps": summary["discarded_steps"],
        "healed_replicas": summary["healed_replicas"],
        "seconds_lost": summary["seconds_lost"],
        "survivor_restarted": any(
            len({s.pid for s in survivors if s.replica == r}) > 1 for r in range(replicas) if r != victim
        ),
        "steps_redone": redone,
        "weights_equal": equal,
        "timeline": [[round(s.t - killed, 3), s.replica, s.step, s.pid] for s in job.steps],
    }


def elastic_reference(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [row for row in json.loads(path.read_text())["summary"] if row["plan"] == "dp=2"]


def plot(trials: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(trials), 1, figsize=(9, 1.8 * len(trials) + 0.6), squeeze=False)
    for ax, t in zip(axes[:, 0], trials):
        for r in range(t["replicas"]):
            points = [(x, step) for x, rep, step, _ in t["timeline"] if rep == r]
            killed = r == t["victim"]  # drawn larger, underneath: the groups step together, so the points overlap
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                "o" if killed else ".",
                ms=6 if killed else 3,
                zorder=1 if killed else 2,
                label=f"group {r}" + (" (killed)" if killed else ""),
            )
        ax.axvline(0, color="red", lw=1)
        ax.set_ylabel("committed step")
        ax.set_title(
            f"{t['replicas']} groups, group {t['victim']} killed in step {t['killed_in_step']}: next commit "
            f"{t['to_next_commit_s']} s, back after {t['back_s']} s, {t['discarded_steps']} discarded",
            fontsize=8,
        )
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel("seconds from the kill")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4, help="trials, alternating 2 and 3 groups")
    parser.add_argument("--sleep", type=float, default=0.3, help="seconds each step waits after its backward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heartbeat", type=float, default=1.0,
                        help="the lighthouse's heartbeat expiry in seconds (the tests' 1; shardwise's default is 5)")
    parser.add_argument("--out", default="bench/results/ft_trials.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    trials: list[dict] = []
    failed: list[str] = []
    for i in range(args.trials):
        work = Path(tempfile.mkdtemp(prefix="ft-trial-"))
        try:
            trials.append(trial(work, replicas=2 + i % 2, rng=rng, sleep_s=args.sleep, heartbeat_s=args.heartbeat))
        except (TimeoutError, OSError, KeyError) as err:  # recorded, and the other trials still run
            print(f"trial {i} failed: {err}", flush=True)
            failed.append(str(err)[:2000])
            continue
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({k: v for k, v in trials[-1].items() if k != "timeline"}), flush=True)

    def med(key: str) -> float | None:
        values = [t[key] for t in trials if t[key] is not None]
        return statistics.median(values) if values else None

    summary = {
        "trials": len(trials),
        "median_to_next_commit_s": med("to_next_commit_s"),
        "median_back_s": med("back_s"),
        "median_heal_s": med("heal_s"),
        "discarded_steps": [t["discarded_steps"] for t in trials],
        "steps_redone_by_survivors": sum(t["steps_redone"] for t in trials),
        "survivors_restarted": sum(t["survivor_restarted"] for t in trials),
        "all_weights_equal": all(t["weights_equal"] for t in trials),
        "failed_trials": failed,
    }
    out = Path(args.out)
    elastic = elastic_reference(out.parent / "node_loss_cost.json")
    result = {
        "command": "python bench/ft_trials.py " + " ".join(sys.argv[1:]),
        "cpu_count": os.cpu_count(),
        "steps": STEPS,
        "ft_flags": h.FAST + ["--ft-heartbeat-timeout", f"{args.heartbeat:g}"],
        "sleep_s": args.sleep,
        "summary": summary,
        "elastic_dp2_node_loss_cost": elastic,
        "trials": trials,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(trials, out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))
    for row in elastic:
        print(
            f"elastic restart ({row['event']}): first step after {row['median_to_first_step_s']} s, steps redone "
            f"{row['steps_redone']}"
        )


if __name__ == "__main__":
    main()
