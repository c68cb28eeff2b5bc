"""Explanations of estimates: the terms that make up a step, and why one plan beats another.

A step is ``compute (GEMMs, attention, pointwise work, LM head and loss, recomputation, launch
overhead) + pipeline bubble + exposed tensor-parallel, pipeline and data-parallel communication +
optimizer``; :func:`terms` lists those seconds, :func:`dominant_terms` names the largest,
:func:`explain` says why the fastest plan beats the runner-up and :func:`explain_gap` which terms
make a plan faster than a reference layout (what ``shardwise plan --fixed ... --explain`` and
``bench/planner_published.py`` print when the free search claims a large gain).
"""

from __future__ import annotations

from shardwise.plan.cost import Estimate

TERM_NAMES = {
    "gemm": "GEMMs",
    "attention": "attention",
    "pointwise": "pointwise work",
    "head": "LM head + loss",
    "recompute": "recomputation",
    "launch": "launch overhead",
    "layers": "layers (measured rate)",
    "accumulate": "gradient accumulation",
    "fp8_casts": "FP8 casts",
    "bubble": "pipeline bubble",
    "tp_comm": "tensor-parallel communication",
    "pp_comm": "pipeline sends",
    "cp_comm": "context-parallel keys and values",
    "dp_comm_exposed": "exposed data-parallel traffic",
    "optimizer": "optimizer step",
}


def terms(est: Estimate) -> dict[str, float]:
    """Seconds of each term of the step (they add up to ``step_time_s``)."""
    out = {k[len("compute_") :]: v for k, v in est.detail.items() if k.startswith("compute_")}
    covered = sum(out.values())
    rest = est.time["compute"] - est.detail.get("optimizer", 0.0) - covered
    if abs(rest) > 1e-12 * max(1.0, est.step_time_s):
        out["launch"] = out.get("launch", 0.0) + rest
    out.update(
        {
            "bubble": est.time["bubble"],
            "tp_comm": est.detail.get("tp_comm", 0.0),
            "pp_comm": est.detail.get("pp_comm", 0.0),
            "cp_comm": est.detail.get("cp_comm", 0.0),
            "dp_comm_exposed": est.detail.get("dp_comm_exposed", 0.0),
            "optimizer": est.detail.get("optimizer", 0.0),
        }
    )
    return {k: v for k, v in out.items() if abs(v) > 0}


def _s(x: float) -> str:
    return f"{x:.3g} s" if x >= 1e-3 else f"{x * 1e3:.3g} ms"


def dominant_terms(est: Estimate, k: int = 3) -> str:
    """One line: the step and its ``k`` largest terms with their shares."""
    items = sorted(terms(est).items(), key=lambda kv: -kv[1])
    step = est.step_time_s
    parts = ", ".join(f"{TERM_NAMES.get(name, name)} {_s(sec)} ({100 * sec / step:.0f}%)" for name, sec in items[:k])
    mem = est.memory
    return (
        f"{est.plan}: step {_s(step)} = {parts}; memory {est.memory_total / 1e9:.3g} GB = states "
        f"{est.model_state_bytes / 1e9:.3g} + activations {mem['activations'] / 1e9:.3g} "
        f"+ buffers {mem['buffers'] / 1e9:.3g}"
    )


def explain_gap(fast: Estimate, ref: Estimate, k: int = 2) -> str:
    """Which terms make ``fast`` faster than ``ref`` (largest savings first), and any that are worse."""
    a, b = terms(fast), terms(ref)
    noise = 1e-4 * ref.step_time_s  # rounding of terms that cancel
    diffs = {name: d for name in set(a) | set(b) if abs(d := b.get(name, 0.0) - a.get(name, 0.0)) > noise}
    gains = sorted(((n, d) for n, d in diffs.items() if d > 0), key=lambda kv: -kv[1])[:k]
    losses = sorted(((n, -d) for n, d in diffs.items() if d < 0), key=lambda kv: -kv[1])[:1]
    ratio = ref.step_time_s / fast.step_time_s if fast.step_time_s else float("inf")
    said = (
        " and ".join(f"{TERM_NAMES.get(n, n)} ({_s(b.get(n, 0.0))} -> {_s(a.get(n, 0.0))})" for n, _ in gains)
        or "nothing"
    )
    worse = f"; its {TERM_NAMES.get(losses[0][0], losses[0][0])} is {_s(losses[0][1])} longer" if losses else ""
    return f"{fast.plan} is predicted {ratio:.2f}x faster than {ref.plan}, mainly through {said}{worse}."


def explain(best: Estimate, runner: Estimate) -> str:
    """One sentence: why ``best`` beats ``runner`` (the biggest time component that differs)."""
    gap = runner.step_time_s - best.step_time_s
    pct = 100 * gap / runner.step_time_s if runner.step_time_s else 0.0
    diffs = {k: runner.time[k] - best.time[k] for k in best.time}
    key = max(diffs, key=lambda k: diffs[k])
    why = {
        "compute": "less compute per device",
        "bubble": "a smaller pipeline bubble",
        "communication": "less exposed communication",
    }[key]
    if key == "compute" and best.plan.recompute != runner.plan.recompute:
        why = (
            f"no {runner.plan.recompute} recomputation"
            if best.plan.recompute == "none"
            else f"{best.plan.recompute} instead of {runner.plan.recompute} recomputation"
        )
    if key == "communication":
        parts = {
            "tp_comm": "tensor-parallel all-reduces",
            "pp_comm": "pipeline sends",
            "dp_comm_exposed": "data-parallel gradient/parameter traffic",
        }
        sub = max(parts, key=lambda k: runner.detail[k] - best.detail[k])
        why = f"less {parts[sub]} ({runner.detail[sub] - best.detail[sub]:.3g} s)"
    if key == "bubble":
        why = (
            f"a smaller pipeline bubble ({best.time['bubble']:.3g} s vs {runner.time['bubble']:.3g} s: "
            f"pp={best.plan.pp}, m={best.plan.microbatches}, v={best.plan.virtual_stages} vs pp={runner.plan.pp}, "
            f"m={runner.plan.microbatches}, v={runner.plan.virtual_stages})"
        )
    tail = ""
    worse = [k for k, d in diffs.items() if d < 0]
    if worse:
        tail = f", although its {worse[0]} is {-diffs[worse[0]]:.3g} s longer"
    if gap <= 0:
        return f"{best.plan} and {runner.plan} are predicted equally fast; the first needs less memory."
    return (
        f"{best.plan} beats {runner.plan} by {pct:.1f}% "
        f"({best.step_time_s:.4g} s vs {runner.step_time_s:.4g} s per step) "
        f"mainly through {why}{tail}."
    )


__all__ = ["TERM_NAMES", "dominant_terms", "explain", "explain_gap", "terms"]
