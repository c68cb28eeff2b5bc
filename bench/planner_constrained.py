"""The planner under a memory budget: does ``Trainer(plan="auto")`` pick the fastest plan that fits?

``bench/planner_validation.py`` measured every valid plan of 4 processes; on this VM the fastest,
``dp=4``, is also the simplest, so an auto plan that matches it proves little. Here the planner gets
a device-memory budget (``--memory-mb``, of which 90% is usable, as for any device) that rules out
``dp=4`` and the other plans whose predicted memory exceeds it. From the stored sweep this script
finds the measured-fastest plan among those that fit and that the Trainer can run (a pipeline, or
one microbatch: the Trainer accumulates gradients itself), then times ``Trainer(plan="auto")``
with the budgeted spec (``SHARDWISE_CLUSTER``) against ``Trainer(plan=<that plan>)`` in the
Trainer's own loop, rounds in rotating order, and reports the median of the paired ratios.

Memory is a budget for the planner here (a CPU process is not stopped at it); the memory model
itself is validated by the other benchmarks (model states exact on 11 layouts; activations within
2% on an H200).

    .venv/bin/python bench/planner_constrained.py --results bench/results/planner_validation.json --memory-mb 24
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, HERE)

from planner_validation import measure_trainer  # noqa: E402

from shardwise.plan.cluster import ClusterSpec  # noqa: E402
from shardwise.plan.cost import StatePolicy, estimate  # noqa: E402
from shardwise.layout import Plan  # noqa: E402
from shardwise.plan.stats import transformer_stats  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--results", default=os.path.join(RESULTS, "planner_validation.json"), help="a planner_validation.py result"
    )
    ap.add_argument(
        "--memory-mb", type=float, default=24.0, help="device memory the planner may assume (MiB; 90%% usable)"
    )
    ap.add_argument("--trainer-rounds", type=int, default=5)
    ap.add_argument("--trainer-steps", type=int, default=6)
    args = ap.parse_args()

    from shardwise.models.gpt import GPTConfig

    with open(args.results) as fh:
        sweep = json.load(fh)
    args.global_batch = sweep["global_batch"]
    cluster = ClusterSpec.from_dict(sweep["cluster"])
    budget = replace(cluster, memory_bytes=args.memory_mb * 2**20, name=f"{cluster.name}-budget-{args.memory_mb:g}MiB")
    stats = transformer_stats(GPTConfig(**sweep["config"]))
    policy = StatePolicy.torch("fp32", "adam")
    rows = []
    for row in sweep["time"]:
        plan = Plan.parse(row["plan"])
        est = estimate(stats, budget, plan, global_batch=args.global_batch, policy=policy)
        runnable = plan.pp > 1 or plan.microbatches == 1
        rows.append({"plan": row["plan"], "measured_s": row["measured_s"], "predicted_s": est.step_time_s,
                     "memory_mb": est.memory_total / 2**20, "fits": est.fits, "trainer_runnable": runnable})
    fitting = [r for r in rows if r["fits"] and r["trainer_runnable"]]
    if not fitting:
        print(f"no measured plan fits {args.memory_mb:g} MiB; raise --memory-mb")
        return 2
    best = min(fitting, key=lambda r: r["measured_s"])
    overall = min(rows, key=lambda r: r["measured_s"])
    print(
        f"budget {args.memory_mb:g} MiB ({0.9 * args.memory_mb:.1f} usable): {len(fitting)} of {len(rows)} measured "
        f"plans fit and run in the Trainer; fastest of them {best['plan']} ({1e3 * best['measured_s']:.1f} ms in the "
        f"sweep); unconstrained fastest {overall['plan']} ({overall['memory_mb']:.1f} MiB predicted: "
        f"{'fits' if overall['fits'] else 'does not fit'})",
        flush=True,
    )
    spec_path = os.path.join(RESULTS, "planner_constrained_cluster.json")
    budget.save(spec_path)
    os.environ["SHARDWISE_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardwise-bench-cache-")
    trainer = measure_trainer(sweep["config"], args, best["plan"], runs={"auto": ("auto", spec_path)})
    auto = trainer.get("auto", {})
    summary = {"memory_mb": args.memory_mb, "fitting_plans": len(fitting), "best_fitting": best["plan"],
               "unconstrained_best": overall["plan"], "unconstrained_best_fits": overall["fits"],
               "auto_plan": auto.get("plan"), "auto_ratio_to_best": auto.get("ratio_to_best"),
               "auto_within_10pct": bool(auto and auto["ratio_to_best"] <= 1.10)}
    if auto:
        print(f"Trainer(plan='auto') under the budget chose {auto['plan']}: {auto['ratio_to_best']:.3f} x "
              f"Trainer(plan='{best['plan']}') in the same loop (median of {len(auto['pair_ratios'])} paired rounds) "
              f"-> within 10%: {summary['auto_within_10pct']}")
    else:
        print(f"Trainer(plan='auto') failed: {trainer.get('errors')}")
    out = {"summary": summary, "rows": rows, "trainer": trainer, "cluster": budget.to_dict()}
    with open(os.path.join(RESULTS, "planner_constrained.json"), "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {RESULTS}/planner_constrained.json")
    return 0 if auto else 1


if __name__ == "__main__":
    raise SystemExit(main())
