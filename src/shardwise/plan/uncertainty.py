"""How far a step-time prediction can be off: an interval from the cross-validated error of its kind of run.

``bench/planner_published.py`` predicts every published run with the per-chip efficiencies refitted
*without* the run's own source (leave-one-source-out) and keeps the residuals ``r = published /
predicted`` tokens/s. For each kind of run — its chip, its parallelism (``pp`` when pipelined, else
``tp``, else ``sharded`` for ZeRO/FSDP, else ``dp``) and its scale (``small``: at most 64 devices,
``large`` above) — with at least 8 such residuals, :data:`INTERVALS` holds the 5% and 95%
quantiles of ``r`` within its source (over the source's median), widened both ways by the largest
bias ``B`` a source had (``low = q05 / B``, ``high = q95 B``): a source we never saw scatters
around a bias of its own, of unknown sign. A prediction of ``T`` tokens/s carries ``[T low, T
high]``. The most
specific kind with residuals is used (``A100/pp/large``, then ``A100/pp``, ``pp/large``, ``pp``,
then ``all``), so a kind of run no published source measured gets the wider pooled interval.

A chip whose runs all come from one source (the H100: torchtitan's three) has numbers no fold could
refit: they are carried over from the A100 by ratios (:mod:`shardwise.plan.cluster`), and the
residuals of other chips do not measure how wrong that carry-over is. Its interval is the pooled
one widened both ways by :data:`CARRIED` ``[chip]``, the largest factor a held-out prediction of
that chip was off by (``low / C``, ``high C``); a chip no published run measured (a V100, a CPU, a
calibrated spec) borrows the largest such factor.

The numbers below are what the benchmark wrote to ``bench/results/planner_published.json``
(``cv.intervals``); ``tests/unit/test_planner_uncertainty.py`` checks that they still are.
"""

from __future__ import annotations

from typing import Any

QUANTILES = (0.05, 0.95)
SMALL = 64  # devices: a "small" run at most this many
CHIPS = {
    "a100-40gb": "A100",
    "a100-80gb": "A100",
    "a800": "A100",
    "h100": "H100",
    "h200": "H100",
    "h800": "H100",
    "v100": "V100",
}

# published / predicted tokens/s, leave-one-source-out (bench/results/planner_published.json "cv" -> "intervals")
INTERVALS: dict[str, dict[str, float]] = {
    "A100/pp": {"low": 0.836, "high": 1.301, "runs": 15},
    "A100/pp/large": {"low": 0.841, "high": 1.311, "runs": 13},
    "A100/sharded": {"low": 0.796, "high": 1.292, "runs": 86},
    "A100/sharded/large": {"low": 0.81, "high": 1.233, "runs": 9},
    "A100/sharded/small": {"low": 0.799, "high": 1.301, "runs": 77},
    "all": {"low": 0.794, "high": 1.288, "runs": 110},
    "pp": {"low": 0.836, "high": 1.301, "runs": 15},
    "pp/large": {"low": 0.841, "high": 1.311, "runs": 13},
    "sharded": {"low": 0.796, "high": 1.292, "runs": 86},
    "sharded/large": {"low": 0.81, "high": 1.233, "runs": 9},
    "sharded/small": {"low": 0.799, "high": 1.301, "runs": 77},
    "tp": {"low": 0.746, "high": 1.17, "runs": 8},
}


# chip -> the largest max(r, 1/r) of its held-out residuals, for chips measured by one source only
# (bench/results/planner_published.json "cv" -> "carried")
CARRIED: dict[str, dict[str, float]] = {"H100": {"factor": 1.18, "runs": 3}}


def carried_factor(chip: str, table: dict[str, Any] | None = None, carried: dict[str, Any] | None = None) -> float:
    """How much wider than its kind's band a chip's interval is: 1 for a chip with cross-validated
    kinds of its own in ``table``, its :data:`CARRIED` factor for a chip one source measured, the
    largest carried factor for a chip nothing published measured."""
    table = INTERVALS if table is None else table
    carried = CARRIED if carried is None else carried
    if any(k.startswith(f"{chip}/") for k in table):
        return 1.0
    if chip in carried:
        return float(carried[chip]["factor"])
    return max([float(c["factor"]) for c in carried.values()] or [1.0])


def band(
    keys: list[str], table: dict[str, Any] | None = None, carried: dict[str, Any] | None = None
) -> tuple[float, float, str]:
    """(low, high) multipliers of a prediction whose kinds are ``keys`` (the chip first), and the kind."""
    table = INTERVALS if table is None else table
    key = interval_key(keys, table)
    widen = carried_factor(keys[0].split("/")[0], table, carried)
    return table[key]["low"] / widen, table[key]["high"] * widen, key


def _parallelism(plan: Any) -> str:
    if plan.pp > 1:
        return "pp"
    if plan.tp > 1:
        return "tp"
    return "sharded" if plan.zero > 0 else "dp"


def kind_keys(plan: Any, cluster: Any) -> list[str]:
    """The kinds a plan on a cluster belongs to, most specific first, ``all`` last."""
    chip = CHIPS.get(getattr(cluster, "name", ""), getattr(cluster, "device_type", "other"))
    par = _parallelism(plan)
    scale = "small" if plan.world_size <= SMALL else "large"
    return [f"{chip}/{par}/{scale}", f"{chip}/{par}", f"{par}/{scale}", par, "all"]


def interval_key(keys: list[str], table: dict[str, Any] | None = None) -> str:
    """The most specific of ``keys`` that ``table`` (default :data:`INTERVALS`) has."""
    table = INTERVALS if table is None else table
    return next(k for k in keys if k in table)


def interval(est: Any, cluster: Any) -> tuple[float, float, str]:
    """(low, high) tokens/s of ``est`` and the kind whose cross-validated residuals gave them."""
    low, high, key = band(kind_keys(est.plan, cluster))
    return est.tokens_per_s * low, est.tokens_per_s * high, key


def indistinct(best: Any, other: Any, cluster: Any) -> bool:
    """Whether ``other``'s predicted throughput lies inside ``best``'s interval: the ranking of the
    two is within the model's cross-validated error."""
    low, high, _ = interval(best, cluster)
    return low <= other.tokens_per_s <= high


def interval_text(est: Any, cluster: Any) -> str:
    low, high, key = interval(est, cluster)
    runs = INTERVALS[key].get("runs", 0)
    chip = kind_keys(est.plan, cluster)[0].split("/")[0]
    widen = carried_factor(chip)
    unmeasured = (
        ""
        if getattr(cluster, "name", "") in CHIPS
        else f"; no published run measured a {getattr(cluster, 'name', 'device')}"
    )
    if widen == 1.0:
        carried = ""
    elif chip in CARRIED:
        carried = (
            f"; widened {widen:.2f}x both ways: the {chip} figures are carried over from the A100, not cross-validated"
        )
    else:
        carried = f"; widened {widen:.2f}x both ways, as for the least validated chip measured"
    return (
        f"{low:.4g}-{high:.4g} tok/s ({low / est.tokens_per_s:.2f}-{high / est.tokens_per_s:.2f} x the prediction: "
        "the 90% interval "
        f"of {runs:g} published runs of kind {key}, each predicted without its source{unmeasured}{carried})"
    )


# -- the validated envelope -------------------------------------------------------------------------
# No searched plan is predicted faster than the cost model was ever checked at: the best model-FLOPs
# utilization (MFU, of the bf16 peak) a published run of its chip measured, plus ENVELOPE_MARGIN.
# bench/planner_published.py reads it off the published runs (`envelope` in
# bench/results/planner_published.json; in its cross-validation each source's plans are bounded by the
# envelope of the other sources' runs). A100: 60.4%, torchtitan's Llama 2 13B on 64 A100s without
# recomputation, the best of the 107 A100 runs. H100/H200/H800: the A100's figure times the ratio of
# the two chips' GEMM efficiencies (0.631 / 0.75; the only H100 runs here, torchtitan's 405B at 29% on
# lower-power parts, are below it). FP8 linears: the bf16 figure times the largest FP8 over bf16 gain a
# published run measured (`fp8_gain`: Llama 3.1 405B in torchtitan, 185 / 109 tokens/s with Float8 and
# async TP); with no FP8 run to read it from, the FP8 peak's 2x times FP8's GEMM efficiency relative to
# bf16 (FP8_PRIOR).
ENVELOPE_MARGIN = 0.05
ENVELOPE_MFU: dict[str, float] = {"A100": 0.604, "H100": 0.508, "V100": 0.604, "fp8_gain": 1.697}
FP8_PRIOR = 1.74  # 2 x the bf16 peak x 0.87 (shardwise.plan.cluster.FP8_RELATIVE_EFFICIENCY)
FP8_GAIN = ENVELOPE_MFU["fp8_gain"]


def envelope_mfu(cluster: Any, precision: str, table: dict[str, float] | None = None) -> float | None:
    """The highest MFU (of the bf16 peak) a plan on this chip may be predicted at, or None for a
    device no published run measured (a CPU, a calibrated spec). ``table``: chip -> best measured
    MFU and ``fp8_gain`` (default :data:`ENVELOPE_MFU`, what the published runs measured)."""
    table = ENVELOPE_MFU if table is None else table
    chip = CHIPS.get(getattr(cluster, "name", ""))
    if chip is None or chip not in table:
        return None
    gain = table.get("fp8_gain", FP8_PRIOR) if precision == "fp8" else 1.0
    return table[chip] * (1 + ENVELOPE_MARGIN) * gain


def bounded(est: Any, cluster: Any, table: dict[str, float] | None = None) -> Any:
    """``est`` with its step time raised to the envelope when it is predicted faster (the excess
    is ``detail["envelope_s"]``): the model has not been validated beyond it."""
    cap = envelope_mfu(cluster, est.plan.precision, table)
    if cap is None or est.mfu <= cap:
        return est
    from dataclasses import replace

    factor = est.mfu / cap
    step = est.step_time_s * factor
    return replace(
        est,
        step_time_s=step,
        tokens_per_s=est.tokens_per_s / factor,
        tflops_per_device=est.tflops_per_device / factor,
        mfu=cap,
        detail={**est.detail, "envelope_s": step - est.step_time_s},
    )


__all__ = [
    "CARRIED",
    "ENVELOPE_MFU",
    "INTERVALS",
    "QUANTILES",
    "band",
    "bounded",
    "carried_factor",
    "envelope_mfu",
    "indistinct",
    "interval",
    "interval_key",
    "interval_text",
    "kind_keys",
]
