"""Validate the planner's cost model against measurements on this machine.

1. Calibrate: measure matmul throughput, operator overhead, memory bandwidth and collective
   bandwidth/latency with 4 local processes (``shardwise.calibrate.calibration``), or load ``--spec``.
2. Memory: for DDP, ZeRO 1-3, TP, DP x TP, FSDP x TP (and PP once the parallel layer applies it),
   train the built-in GPT a step under the plan on 4 Gloo processes and compare each rank's
   measured parameter + gradient + optimizer-state bytes with the prediction (target: within 10%).
3. Time: run the built-in GPT under every valid plan of 4 processes that the parallel layer can
   apply, measure the median step time (rounds interleaved across plans, so machine load drifts hit
   every plan alike), and report the Spearman rank correlation of predicted vs measured times and
   whether the predicted-best plan is within 10% of the measured best.

Writes bench/results/planner_validation.json and bench/results/planner_validation.png.

    .venv/bin/python bench/planner_validation.py [--spec cluster.json] [--rounds 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, os.path.dirname(HERE))

from shardwise.plan.cluster import ClusterSpec  # noqa: E402
from shardwise.plan.cost import StatePolicy, estimate  # noqa: E402
from shardwise.calibrate.measure import measure_plan_worker  # noqa: E402
from shardwise.layout import Plan  # noqa: E402
from shardwise.plan.search import SearchOptions, _enumerate  # noqa: E402
from shardwise.plan.stats import transformer_stats  # noqa: E402
from shardwise.testing import WorkerPool  # noqa: E402
from bench.trainer_timing import measure_trainer_worker  # noqa: E402 (by module path, for pickling)

WORLD = 4
MEMORY_PLANS = ["dp=4", "zero=1,dp=4", "zero=2,dp=4", "zero=3,dp=4", "zero=3,dp=2,shard=2", "tp=4", "dp=2,tp=2",
                "zero=3,dp=2,tp=2", "pp=2,dp=2,microbatches=2", "pp=4,microbatches=4", "pp=2,tp=2,microbatches=2"]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: Pearson correlation of the (average) ranks."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def run(pool: WorkerPool, text: str, config: dict, *, worker=measure_plan_worker, **kwargs) -> dict:
    """One plan on the pool; a failure or a hang becomes an error row (the pool restarts itself)."""
    for attempt in range(3):
        try:
            return pool.run(worker, text, config, timeout_s=240.0, **kwargs)[0]
        except AssertionError as exc:  # RankFailed / RanksTimedOut from the harness
            error = {"plan": text, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            if "start-up" not in error["error"]:  # a loaded machine can miss the start-up deadline: retry
                return error
    return error


def candidate_plans(stats, cluster: ClusterSpec, global_batch: int) -> list[Plan]:
    """Every valid plan for 4 processes (no recomputation, microbatches up to 2 x pp)."""
    opts = SearchOptions(precision="fp32", recompute=("none",), sequence_parallel=False, schedules=("1f1b", "gpipe"),
                         max_microbatches=8)
    every, _ = _enumerate(stats, cluster, global_batch, opts, keep_all=True)
    plans = []
    for est in every:
        p = est.plan
        if p.microbatches > max(2, 2 * p.pp) or (p.pp > 1 and p.microbatches < p.pp):
            continue
        plans.append(p)
    return list(dict.fromkeys(plans))


def measure(stats, cluster: ClusterSpec, config: dict, args: argparse.Namespace) -> tuple[dict, dict, dict, list[Plan]]:
    """Run the memory plans once and every valid plan ``args.rounds`` times (order alternating)."""
    pool = WorkerPool(WORLD, timeout_s=600.0)
    try:
        memory: dict[str, dict] = {}
        for text in MEMORY_PLANS:
            got = run(pool, text, config, global_batch=args.global_batch, steps=1, warmup=0)
            memory[text] = {"error": got["error"]} if "error" in got else got["memory"]
            print(f"measured memory of {text}", flush=True)
        plans = candidate_plans(stats, cluster, args.global_batch)
        print(f"\ntiming {len(plans)} valid plans x {args.rounds} rounds ...", flush=True)
        times: dict[str, list[float]] = {str(p): [] for p in plans}
        errors: dict[str, str] = {}
        for r in range(args.rounds):
            order = plans if r % 2 == 0 else plans[::-1]  # alternate the order: drift hits all plans alike
            for p in order:
                if str(p) in errors:
                    continue
                got = run(pool, str(p), config, global_batch=args.global_batch, steps=args.steps, warmup=1)
                if "error" in got:
                    errors[str(p)] = got["error"]
                else:
                    times[str(p)].extend(got["times"])
        return memory, {k: v for k, v in times.items() if k not in errors}, errors, plans
    finally:
        pool.close()


def measure_trainer(config: dict, args: argparse.Namespace, best: str,
                    runs: dict[str, tuple[str, str | None]] | None = None) -> dict:
    """``Trainer(plan="auto")`` through the Trainer's own loop, against the measured-best plan run
    by the same loop: per round, the default auto path (the Trainer measures this machine in its
    own world the first time, into an empty cache directory, then reads the cached spec), the
    planner on the generic ``cpu`` preset (``SHARDWISE_CLUSTER=cpu``) and the explicit best plan,
    in an order that rotates every round; the headline is the median of the per-round ratios
    auto / best (paired, so load drifts cancel). ``runs``: name -> (plan text, SHARDWISE_CLUSTER)
    instead of those three ("best" is always added)."""
    runs = dict(runs or {"auto": ("auto", None), "auto_preset": ("auto", "cpu")})
    runs["best"] = (best, None)
    times: dict[str, list[float]] = {k: [] for k in runs}
    chosen: dict[str, str] = {}
    errors: dict[str, str] = {}
    pool = WorkerPool(WORLD, timeout_s=600.0)
    try:
        names = list(runs)
        for r in range(args.trainer_rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                text, cluster = runs[name]
                got = run(pool, text, config, worker=measure_trainer_worker, global_batch=args.global_batch,
                          steps=args.trainer_steps, warmup=2, cluster=cluster)
                if "error" in got:
                    errors[name] = got["error"]
                    continue
                chosen[name] = got["chosen"]
                times[name].append(got["step_time_s"])
            print(f"trainer round {r + 1}/{args.trainer_rounds}: "
                  + ", ".join(f"{k} {1e3 * v[-1]:.1f} ms" for k, v in times.items() if v), flush=True)
    finally:
        pool.close()
    out: dict = {"best_plan": best, "chosen": chosen, "times": times, "errors": errors, "rounds": args.trainer_rounds}
    for name in (n for n in runs if n != "best"):
        pairs = [a / b for a, b in zip(times[name], times["best"])]
        if pairs:
            out[name] = {"plan": chosen.get(name), "median_s": statistics.median(times[name]),
                         "ratio_to_best": statistics.median(pairs), "pair_ratios": pairs}
    if times["best"]:
        out["best_median_s"] = statistics.median(times["best"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=None, help="cluster spec from `shardwise calibrate` (default: calibrate now)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all plans")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per plan and round (after one warm-up)")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument(
        "--trainer-rounds",
        type=int,
        default=None,
        help="interleaved rounds of Trainer(plan='auto') vs the best plan (default 5; with --reuse: keep the stored "
        "ones unless given)",
    )
    ap.add_argument("--trainer-steps", type=int, default=6, help="timed Trainer steps per run (after 2 warm-up steps)")
    ap.add_argument(
        "--reuse", default=None, help="a previous results JSON: re-predict its measurements (e.g. with a new --spec)"
    )
    args = ap.parse_args()
    os.makedirs(RESULTS, exist_ok=True)

    from shardwise.models.gpt import GPTConfig
    from shardwise.calibrate.calibration import calibrate

    started = time.time()
    # Trainer(plan="auto") measures this machine on first use and caches it: start from an empty
    # cache, as a first-time user does (the worker processes inherit the variable).
    os.environ["SHARDWISE_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardwise-bench-cache-")
    spec_path = os.path.abspath(args.spec) if args.spec else os.path.join(RESULTS, "planner_validation_cluster.json")
    if args.spec:
        cluster = ClusterSpec.load(args.spec)
    else:
        print("calibrating (4 processes) ...", flush=True)
        cluster = calibrate(WORLD, iters=5)
        cluster.save(spec_path)
    cluster = cluster.with_devices(WORLD, WORLD)
    config = {"vocab_size": 128, "seq_len": args.seq, "layers": args.layers, "hidden": args.hidden, "heads": 4}
    stats = transformer_stats(GPTConfig(**config))
    policy = StatePolicy.torch("fp32", "adam")
    if args.reuse:
        with open(args.reuse) as fh:
            previous = json.load(fh)
        measured_memory = {r["plan"]: r.get("measured") or {"error": r.get("error")} for r in previous["memory"]}
        # keyed by the plan as it prints today (a default microbatch count is no longer spelled out)
        times = {str(Plan.parse(r["plan"])): r.get("times") or [r["measured_s"]] for r in previous["time"]}
        errors = {str(Plan.parse(k)): v for k, v in previous["not_measured"].items()}
        plans = [Plan.parse(t) for t in times] + [Plan.parse(t) for t in errors]
        print(f"re-predicting {len(times)} stored measurements from {args.reuse} with {cluster.name}")
    else:
        measured_memory, times, errors, plans = measure(stats, cluster, config, args)
    memory_rows = []
    for text in MEMORY_PLANS:
        got = measured_memory.get(text, {"error": "not run"})
        row = {"plan": text}
        if "error" in got:
            row["error"] = got["error"]
        else:
            pred = estimate(stats, cluster, Plan.parse(text), global_batch=args.global_batch, policy=policy)
            want = {k: pred.memory[k] for k in ("params", "grads", "optimizer")}
            row.update(
                predicted=want, measured=got, rel_error=(sum(got.values()) - sum(want.values())) / sum(want.values())
            )
        memory_rows.append(row)
        print(f"memory {text:<26} " + (f"predicted {sum(row['predicted'].values()) / 1e6:7.3f} MB  measured "
              f"{sum(row['measured'].values()) / 1e6:7.3f} MB  error {100 * row['rel_error']:+5.1f}%"
              if "error" not in row else f"not measured: {row['error']}"), flush=True)
    rows = []
    for p in plans:
        if str(p) in errors:
            continue
        pred = estimate(stats, cluster, p, global_batch=args.global_batch, policy=policy)
        rows.append({"plan": str(p), "predicted_s": pred.step_time_s, "measured_s": statistics.median(times[str(p)]),
                     "times": times[str(p)], "predicted_breakdown": pred.time, "predicted_detail": pred.detail})

    rows.sort(key=lambda r: r["measured_s"])
    for r in rows:
        print(
            f"time {r['plan']:<45} predicted {1e3 * r['predicted_s']:9.1f} ms  measured {1e3 * r['measured_s']:9.1f} ms"
        )
    for text, err in errors.items():
        print(f"time {text:<45} not measured: {err}")
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]) if len(rows) > 1 else float("nan")
    pred_best = min(rows, key=lambda r: r["predicted_s"]) if rows else None
    meas_best = min(rows, key=lambda r: r["measured_s"]) if rows else None
    within = bool(pred_best and pred_best["measured_s"] <= 1.10 * meas_best["measured_s"])
    # Trainer(plan="auto") through the Trainer's own loop, paired with the measured-best plan in
    # the same loop (a --reuse run keeps the stored Trainer measurements).
    if args.reuse and args.trainer_rounds is None:
        trainer = previous.get("trainer", {})
    elif meas_best and (args.trainer_rounds is None or args.trainer_rounds > 0):
        args.trainer_rounds = 5 if args.trainer_rounds is None else args.trainer_rounds
        print(f"\ntiming Trainer(plan='auto') against {meas_best['plan']} in the Trainer's loop, "
              f"{args.trainer_rounds} rounds ...", flush=True)
        trainer = measure_trainer(config, args, meas_best["plan"])
    else:
        trainer = {}
    summary = {
        "spearman": rho,
        "plans_measured": len(rows),
        "plans_not_measured": len(errors),
        "predicted_best": pred_best and pred_best["plan"],
        "measured_best": meas_best and meas_best["plan"],
        "predicted_best_measured_s": pred_best and pred_best["measured_s"],
        "measured_best_s": meas_best and meas_best["measured_s"],
        "predicted_best_gap": pred_best and pred_best["measured_s"] / meas_best["measured_s"] - 1,
        "predicted_best_within_10pct": within,
        "memory_max_abs_error": max((abs(r["rel_error"]) for r in memory_rows if "rel_error" in r), default=None),
    }
    for name in ("auto", "auto_preset"):
        if name in trainer:
            summary[f"trainer_{name}_plan"] = trainer[name]["plan"]
            summary[f"trainer_{name}_ratio_to_best"] = trainer[name]["ratio_to_best"]
            summary[f"trainer_{name}_within_10pct"] = trainer[name]["ratio_to_best"] <= 1.10
    print(f"\nSpearman rank correlation (predicted vs measured step time, {len(rows)} plans): {rho:.3f}")
    if pred_best:
        print(
            f"predicted best {pred_best['plan']}: measured {1e3 * pred_best['measured_s']:.1f} ms vs measured best "
            f"{meas_best['plan']} {1e3 * meas_best['measured_s']:.1f} ms ({100 * summary['predicted_best_gap']:+.1f}%) "
            f"-> within 10%: {within}"
        )
    for name, what in (
        ("auto", "its own measurement of this machine (the default)"),
        ("auto_preset", "the cpu preset"),
    ):
        if name in trainer:
            t = trainer[name]
            print(
                f"Trainer(plan='auto') with {what} chose {t['plan']}: median {1e3 * t['median_s']:.1f} ms in the "
                f"Trainer's loop, {t['ratio_to_best']:.3f} x the best plan in the same loop "
                f"({1e3 * trainer['best_median_s']:.1f} ms) -> within 10%: {t['ratio_to_best'] <= 1.10}"
            )
    print(f"memory: largest |error| {100 * (summary['memory_max_abs_error'] or 0):.1f}% over "
          f"{sum('rel_error' in r for r in memory_rows)} measured plans")
    out = {
        "summary": summary,
        "cluster": cluster.to_dict(),
        "config": config,
        "global_batch": args.global_batch,
        "memory": memory_rows,
        "time": rows,
        "not_measured": errors,
        "trainer": trainer,
        "seconds": time.time() - started,
    }
    with open(os.path.join(RESULTS, "planner_validation.json"), "w") as fh:
        json.dump(out, fh, indent=2)
    plot(out, os.path.join(RESULTS, "planner_validation.png"))
    print(f"wrote {RESULTS}/planner_validation.json and .png")
    return 0


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6))
    rows = out["time"]
    if rows:
        xs = [1e3 * r["predicted_s"] for r in rows]
        ys = [1e3 * r["measured_s"] for r in rows]
        ax1.scatter(xs, ys)
        for x, y, r in zip(xs, ys, rows):
            ax1.annotate(r["plan"].replace(",precision=fp32", ""), (x, y), fontsize=6, alpha=0.8)
        lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.2
        ax1.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
        ax1.set_xscale("log")
        ax1.set_yscale("log")
        ax1.legend()
    s = out["summary"]
    ax1.set_title(
        f"step time, 4 Gloo processes: Spearman {s['spearman']:.2f}, predicted best within 10%: "
        f"{s['predicted_best_within_10pct']}",
        fontsize=9,
    )
    ax1.set_xlabel("predicted (ms)")
    ax1.set_ylabel("measured median (ms)")
    mem = [r for r in out["memory"] if "predicted" in r]
    names = [r["plan"] for r in mem]
    pred = [sum(r["predicted"].values()) / 1e6 for r in mem]
    meas = [sum(r["measured"].values()) / 1e6 for r in mem]
    idx = range(len(mem))
    ax2.bar([i - 0.2 for i in idx], pred, width=0.4, label="predicted")
    ax2.bar([i + 0.2 for i in idx], meas, width=0.4, label="measured")
    ax2.set_xticks(list(idx))
    ax2.set_xticklabels(names, rotation=45, ha="right", fontsize=7)
    ax2.set_ylabel("model-state MB on the busiest rank")
    ax2.set_title("parameters + gradients + Adam state per rank", fontsize=9)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
