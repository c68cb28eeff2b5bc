"""The planner against published GPU training runs.

Every row of ``bench/data/published_throughput.json`` (or ``--runs FILE`` of the same format) is
evaluated with the cluster preset of its GPU (``planner_published_rows`` maps a row):

1. **fixed, with the CLI's defaults** (the headline): the published layout as ``shardwise plan
   --fixed`` keys with nothing else set, so the cost model prices shardwise's own runtime and the
   search chooses its runtime options (16-bit parameters, chunked loss, sharded accumulation) and
   what the row leaves out (e.g. Megatron-LM 2021's microbatch size); predicted tokens/s per GPU
   against the published figure (each source's own FLOP formula, as its notes say), and whether the
   model says it fits in the GPU's memory (every published run ran, so it must): on the whole
   memory, and within the CLI's default 10% headroom;
2. **fixed, under the framework's policy** (the second column): the same layout priced the way that
   row's framework runs a step (precision policy, selective mode, fused loss, ZeRO unit, overlapped
   gradient reduction, ...): how well the cost model describes the run that was measured. The per-chip
   efficiencies are fitted on this column (``--fit``), since it is what ran;
3. **free search, with the CLI's defaults**, at the same GPUs, global batch and sequence length:
   the best plan the search finds, against the best published run of the same setup. Where it
   claims more than 1.3 x the published layout, the output names the terms that make the difference.

It prints first the leave-one-source-out cross-validation (``planner_published_cv``: the A100's
fitted numbers refitted without each source, that source predicted with them, the free search
too; the prediction intervals and their coverage; each fitted number's ablation), then the
in-sample figures per source: the median absolute error, the share within +-15% and +-25%, fit
misses, the printed interval's coverage and the free-search ratios. Writes
``bench/results/planner_published.json``, its log and a log-log plot ``planner_published.png``.

    .venv/bin/python bench/planner_published.py [--runs FILE] [--no-cv] [--no-ablation] [--fit] [--rows] [--no-free]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from planner_published_cv import (  # noqa: E402
    CHIPS,
    cli_options,
    cross_validate,
    envelope_of,
    fit_chips,
    item_of,
    preset_params,
    with_params,
)
from planner_published_report import GAP, markdown, plot, print_cv  # noqa: E402,F401 (markdown: the docs test's)
from planner_published_rows import Case, Skip, cases  # noqa: E402

from shardwise.plan.cluster import ClusterSpec  # noqa: E402
from shardwise.plan.cost import Estimate  # noqa: E402
from shardwise.plan.explain import dominant_terms, explain_gap  # noqa: E402
from shardwise.plan.search import SearchOptions, candidates, fixed_options, search  # noqa: E402
from shardwise.plan.uncertainty import interval  # noqa: E402

DATA = os.path.join(HERE, "data", "published_throughput.json")
RESULTS = os.path.join(HERE, "results")


def _pick(every: list[Estimate], cluster: ClusterSpec) -> tuple[Estimate, bool, bool]:
    """The fastest plan that fits the whole memory (else the one that needs the least), whether one
    fits, and whether one fits the CLI's default 90%."""
    fitting = [e for e in every if e.fits]
    usable = any(e.memory_total <= 0.9 * cluster.memory_bytes for e in every)
    return (fitting[0], True, usable) if fitting else (min(every, key=lambda e: e.memory_total), False, False)


def cli_estimate(case: Case) -> tuple[Estimate, bool, bool]:
    """The published layout under shardwise's runtime, its options chosen by the search."""
    every = candidates(case.stats, case.cluster, global_batch=case.global_batch, options=cli_options(case))
    if not every:
        raise ValueError(
            f"no plan matches {case.cli_fixed} on {case.cluster.devices} GPUs with global batch {case.global_batch}"
        )
    return _pick(every, case.cluster)


def fixed_estimate(case: Case, params: dict[str, float] | None = None) -> tuple[Estimate, bool]:
    """The published layout under its framework's policy (the planner's choice of what the row
    leaves out) and whether it fits the GPU's whole memory."""
    cluster = with_params(case.cluster, params)
    base = SearchOptions(precision=case.precision, headroom=0.0, top=1, policy=case.policy, run=case.run, hsdp=True,
                         runtime_options=())
    options = fixed_options(case.fixed, base)
    every = candidates(case.stats, cluster, global_batch=case.global_batch, options=options)
    if not every:
        raise ValueError(
            f"no plan matches {case.fixed} on {cluster.devices} GPUs with global batch {case.global_batch}"
        )
    est, fits, _ = _pick(every, cluster)
    return est, fits


def free_estimate(case: Case, params: dict[str, float] | None = None,
                  envelope: dict[str, float] | None = None) -> Estimate | None:
    """The free search with the CLI's defaults (in the row's precision: fp8 rows search fp8), with
    the per-chip numbers ``params`` and the ``envelope`` (the cross-validation's: made without the
    row's source)."""
    precision = "fp8" if "precision=fp8" in case.cli_fixed else case.precision
    found = search(case.stats, with_params(case.cluster, params), global_batch=case.global_batch,
                   options=SearchOptions(precision=precision, top=1, envelope=envelope))
    return found.plans[0] if found.plans else None


def tps(est: Estimate, case: Case) -> float:
    return est.tokens_per_s / case.cluster.devices


def evaluate(
    all_cases: list[Case], *, free: bool = True, free_params: dict[int, dict[str, float]] | None = None,
    free_envelopes: dict[int, dict[str, float]] | None = None,
) -> list[dict[str, Any]]:
    """Every row: the headline (``--fixed``, CLI defaults) with the interval the CLI prints, the
    framework's policy and, with ``free``, the free search (with ``free_params[row index]`` and
    ``free_envelopes[row index]``, the cross-validated numbers and envelope, when given; else the
    presets and the published envelope)."""
    best_published: dict[tuple[Any, ...], float] = {}
    for c in all_cases:
        best_published[c.setup] = max(best_published.get(c.setup, 0.0), c.published_tps)
    out = []
    for case in all_cases:
        try:
            est, fits, usable = cli_estimate(case)
            framework, framework_fits = fixed_estimate(case)
        except ValueError as exc:  # the published layout is no plan the cost model can price
            out.append({"index": case.index, "source": case.source, "label": case.label, "error": str(exc)})
            continue
        row: dict[str, Any] = {
            "index": case.index,
            "source": case.source,
            "label": case.label,
            "fixed": case.cli_fixed,
            "formula": case.formula,
            "gpu": case.cluster.name,
            "gpus": case.cluster.devices,
            "published_tps": case.published_tps,
            "predicted_tps": tps(est, case),
            "ratio": tps(est, case) / case.published_tps,
            "fits": fits,
            "fits_usable": usable,
            "memory_gb": est.memory_total / 1e9,
            "gpu_memory_gb": case.cluster.memory_bytes / 1e9,
            "plan": str(est.plan),
            "options": [k for k in ("params16", "chunked_loss", "sharded_accumulation") if getattr(est.plan, k)],
            "mfu": est.mfu,
            "terms": dominant_terms(est, k=4),
            "framework_fixed": case.fixed,
            "framework_tps": tps(framework, case),
            "framework_ratio": tps(framework, case) / case.published_tps,
            "framework_fits": framework_fits,
            "framework_plan": str(framework.plan),
        }
        low, high, kind = interval(est, case.cluster)
        row.update({"interval_tps": [low / case.cluster.devices, high / case.cluster.devices], "interval_kind": kind,
                    "in_interval": low / case.cluster.devices <= case.published_tps <= high / case.cluster.devices})
        if free:
            best = free_estimate(case, (free_params or {}).get(case.index), (free_envelopes or {}).get(case.index))
            if best is not None:
                row.update({"free_plan": str(best.plan), "free_tps": tps(best, case),
                            "free_over_best_published": tps(best, case) / best_published[case.setup],
                            "free_over_fixed": est.step_time_s / best.step_time_s})
                if row["free_over_fixed"] > GAP:
                    row["why"] = explain_gap(best, est)
        out.append(row)
    return out


def _errors(rows: list[dict[str, Any]]) -> list[float]:
    return [abs(r["ratio"] - 1) for r in rows]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [r for r in rows if "ratio" in r]
    errs = _errors(rows)
    frees = [r["free_over_best_published"] for r in rows if "free_over_best_published" in r]
    framework = [abs(r["framework_ratio"] - 1) for r in rows if "framework_ratio" in r]
    n = max(1, len(errs))
    return {
        "runs": len(rows),
        "median_abs_error": statistics.median(errs) if errs else float("nan"),
        "within_15": sum(e <= 0.15 for e in errs) / n,
        "within_25": sum(e <= 0.25 for e in errs) / n,
        "fit_misses": sum(not r["fits"] for r in rows),
        "fit_misses_usable": sum(not r.get("fits_usable", r["fits"]) for r in rows),
        "free_ratio_median": statistics.median(frees) if frees else float("nan"),
        "free_ratio_max": max(frees, default=float("nan")),
        "free_within_1.3": sum(f <= GAP for f in frees) / max(1, len(frees)),
        "framework_median_abs_error": statistics.median(framework) if framework else float("nan"),
        "framework_fit_misses": sum(not r.get("framework_fits", True) for r in rows),
        "interval_coverage": sum(r.get("in_interval", False) for r in rows) / n,
    }


def free_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in [*sorted({r["source"] for r in rows}), "all"]:
        frees = [
            r["free_over_best_published"]
            for r in rows
            if "free_over_best_published" in r and name in ("all", r["source"])
        ]
        if frees:
            out[name] = {
                "median": statistics.median(frees),
                "max": max(frees),
                "within": sum(f <= GAP for f in frees) / len(frees),
            }
    return out


def _fit_all(items: list[Any]) -> dict[str, Any]:
    """``--fit``: each chip's numbers fitted on all its runs, printed beside the presets'."""
    out = {}
    for chip, params in fit_chips(items).items():
        preset = preset_params(
            next(it.case.cluster for it in items if CHIPS.get(it.case.cluster.name, it.case.cluster.name) == chip)
        )
        runs = sum(CHIPS.get(it.case.cluster.name, it.case.cluster.name) == chip for it in items)
        out[chip] = {"runs": runs, "params": params, "preset": preset}
        print(f"fit {chip} on {runs} runs: " + ", ".join(f"{k} {v:.3f}" for k, v in params.items())
              + "  (preset: " + ", ".join(f"{k} {v:.3f}" for k, v in preset.items()) + ")")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--runs", default=DATA, help="published runs (JSON list of rows; default: bench/data/published_throughput.json)"
    )
    ap.add_argument("--out", default=RESULTS, help="directory for planner_published.json / .png")
    ap.add_argument("--name", default="planner_published", help="file stem of the outputs")
    ap.add_argument(
        "--no-cv",
        action="store_true",
        help="skip the leave-one-source-out cross-validation (the free search then uses the presets)",
    )
    ap.add_argument(
        "--no-ablation", action="store_true", help="cross-validate without the ablations of each fitted number"
    )
    ap.add_argument("--fit", action="store_true", help="fit the per-chip numbers on all runs and print them")
    ap.add_argument("--rows", action="store_true", help="print every row")
    ap.add_argument("--no-free", action="store_true", help="skip the free search")
    args = ap.parse_args(argv)
    with open(args.runs) as fh:
        raw = json.load(fh)
    mapped = cases(raw)
    usable = [c for c in mapped if isinstance(c, Case)]
    skipped = [c for c in mapped if isinstance(c, Skip)]
    start = time.perf_counter()
    items = []
    for c in usable:
        try:
            items.append(item_of(c))
        except ValueError:
            pass  # reported by evaluate() below
    out: dict[str, Any] = {
        "runs_file": os.path.relpath(args.runs, os.path.dirname(HERE))
        if args.runs.startswith(os.path.dirname(HERE))
        else args.runs
    }
    free_params: dict[int, dict[str, float]] = {}
    free_envelopes: dict[int, dict[str, float]] = {}
    if not args.no_cv and items:
        cv = cross_validate(items, ablate=not args.no_ablation)
        for it in items:
            free_params[it.case.index] = cv["params"][it.case.source].get(
                CHIPS.get(it.case.cluster.name, it.case.cluster.name), {}
            )
            free_envelopes[it.case.index] = cv["envelopes"][it.case.source]
        out["cv"] = cv
    out["envelope"] = envelope_of(items) if items else {}
    evaluated = evaluate(usable, free=not args.no_free, free_params=free_params, free_envelopes=free_envelopes)
    elapsed = time.perf_counter() - start
    rows = [r for r in evaluated if "ratio" in r]
    skipped += [Skip(r["index"], r["source"], r["label"], r["error"]) for r in evaluated if "error" in r]
    by_source = {s: summary([r for r in rows if r["source"] == s]) for s in sorted({r["source"] for r in rows})}
    total = summary(rows)
    out.update(
        {
            "overall": total,
            "by_source": by_source,
            "rows": rows,
            "skipped": [s.__dict__ for s in skipped],
            "seconds": elapsed,
        }
    )
    if "cv" in out:
        out["cv"]["free"] = free_summary(rows)
    print(
        f"{len(rows)} runs ({len(skipped)} skipped) from "
        f"{args.runs if args.runs != DATA else 'bench/data/published_throughput.json'}, {elapsed:.1f} s"
    )
    if "cv" in out:
        print_cv(out["cv"])
    print("in-sample (the presets' numbers, fitted on all these runs); envelope of all the runs: "
          + ", ".join(f"{k} {v:.3f}" for k, v in out["envelope"].items()))
    if args.rows:
        for r in rows:
            free = f" free {r['free_over_best_published']:.2f}x" if "free_over_best_published" in r else ""
            print(
                f"{r['index']:>3} {r['ratio']:6.2f} {'fit ' if r['fits'] else 'OOM '} "
                f"{r['memory_gb']:6.1f}/{r['gpu_memory_gb']:.0f} GB (framework {r['framework_ratio']:.2f}) "
                f"{'in ' if r['in_interval'] else 'OUT'} {r['interval_kind']}{free}  {r['label']}  | {r['plan']}"
            )
    head = (
        f"{'source':<45} {'runs':>4} {'med|err|':>8} {'<=15%':>6} {'<=25%':>6} {'no fit':>6} {'>90%':>5} "
        f"{'in int.':>7} {'framework':>9}"
    )
    print(head)
    for name, s in [*by_source.items(), ("all", total)]:
        print(
            f"{name[:45]:<45} {s['runs']:>4} {100 * s['median_abs_error']:>7.1f}% {100 * s['within_15']:>5.0f}% "
            f"{100 * s['within_25']:>5.0f}% {s['fit_misses']:>6} {s['fit_misses_usable']:>5} "
            f"{100 * s['interval_coverage']:>6.0f}% {100 * s['framework_median_abs_error']:>8.1f}%"
        )
    gaps = [r for r in rows if "why" in r]
    if gaps:
        print(f"free search > {GAP}x the published layout ({len(gaps)} runs):")
        for r in gaps:
            print(f"  {r['label']}: {r['why']}")
    for s in skipped:
        print(f"skipped row {s.index} ({s.label}): {s.reason}")
    if args.fit:
        out["fit"] = _fit_all(items)
    print(markdown(out))
    out["seconds_total"] = time.perf_counter() - start
    print(f"{out['seconds_total']:.0f} s in all")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    try:
        plot(rows, os.path.join(args.out, f"{args.name}.png"))
    except ImportError:
        print("matplotlib is not installed (pip install shardwise[plots]): no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
