"""What ``bench/planner_published.py`` prints and draws: the markdown tables docs/planner.md quotes,
the cross-validation's table and the predicted-against-published plot."""

from __future__ import annotations

from typing import Any

GAP = 1.3  # a free-search claim above this over the published layout is explained


def markdown(out: dict[str, Any]) -> str:
    """The summary tables docs/planner.md quotes (tests/unit/test_docs_commands.py regenerates them
    from the committed JSON and compares): cross-validated first, in-sample second."""
    cv = out.get("cv", {})
    lines = ["| source | runs | **cross-validated**: median abs. error | within 15% | median ratio | interval coverage "
             "| free search / best published: median, max | free within 1.3x | framework policy: median error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in cv.get("by_source", {}).items():
        free = cv.get("free", {}).get(name, {})
        lines.append(
            f"| {name} | {s['runs']} | {100 * s['median_abs_error']:.1f}% | {100 * s['within_15']:.0f}% | "
            f"{s['median_ratio']:.2f} | {100 * cv['coverage'].get(name, float('nan')):.0f}% | "
            f"{free.get('median', float('nan')):.2f}, {free.get('max', float('nan')):.2f} | "
            f"{100 * free.get('within', float('nan')):.0f}% | "
            f"{100 * cv['framework_by_source'][name]['median_abs_error']:.1f}% |"
        )
    lines += [
        "",
        "| source | runs | **in-sample**: median abs. error | within 15% | within 25% | predicted not to fit (whole "
        "memory / 90%) | printed interval covers | framework policy: median error, not fit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in [*out["by_source"].items(), ("all", out["overall"])]:
        lines.append(
            f"| {name} | {s['runs']} | {100 * s['median_abs_error']:.1f}% | {100 * s['within_15']:.0f}% | "
            f"{100 * s['within_25']:.0f}% | {s['fit_misses']} / {s['fit_misses_usable']} | "
            f"{100 * s['interval_coverage']:.0f}% | {100 * s['framework_median_abs_error']:.1f}%, "
            f"{s['framework_fit_misses']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    for source in sorted({r["source"] for r in rows}):
        sel = [r for r in rows if r["source"] == source]
        dots = ax.scatter(
            [r["published_tps"] for r in sel],
            [r["predicted_tps"] for r in sel],
            s=18,
            label=f"{source} ({len(sel)})",
            marker="o" if all(r["fits"] for r in sel) else "x",
        )
        ax.scatter([r["published_tps"] for r in sel], [r["framework_tps"] for r in sel], s=10, facecolors="none",
                   edgecolors=dots.get_facecolor(), linewidths=0.6)
    lo = min(min(r["published_tps"], r["predicted_tps"]) for r in rows) / 1.5
    hi = max(max(r["published_tps"], r["predicted_tps"]) for r in rows) * 1.5
    for k, style in ((1.0, "-"), (1.15, ":"), (1 / 1.15, ":")):
        ax.plot([lo, hi], [lo * k, hi * k], "k" + style, lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("published tokens/s per GPU")
    ax.set_ylabel("predicted tokens/s per GPU (published layout)")
    ax.set_title(
        "shardwise plan --fixed vs published runs (filled: CLI defaults;\nhollow: the framework's policy; dotted: "
        "+-15%)",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_cv(cv: dict[str, Any]) -> None:
    print(
        "leave-one-source-out cross-validation (the per-chip numbers refitted without each source, that source "
        "predicted; headline = shardwise plan --fixed <published layout>):"
    )
    print(
        f"{'source':<45} {'runs':>4} {'med|err|':>8} {'<=15%':>6} {'ratio':>6} {'in int.':>7} {'free med':>8} "
        f"{'max':>5} {'<=1.3x':>6} {'framework':>9}  numbers used"
    )
    for name, s in cv["by_source"].items():
        free = cv.get("free", {}).get(name, {})
        params = "; ".join(
            f"{chip}: " + ", ".join(f"{k} {v:.3f}" for k, v in p.items())
            for chip, p in cv["params"].get(name, {}).items()
        )
        print(
            f"{name[:45]:<45} {s['runs']:>4} {100 * s['median_abs_error']:>7.1f}% {100 * s['within_15']:>5.0f}% "
            f"{s['median_ratio']:>6.2f} {100 * cv['coverage'].get(name, float('nan')):>6.0f}% "
            f"{free.get('median', float('nan')):>8.2f} {free.get('max', float('nan')):>5.2f} "
            f"{100 * free.get('within', float('nan')):>5.0f}% "
            f"{100 * cv['framework_by_source'][name]['median_abs_error']:>8.1f}%  {params}"
        )
    print("envelope per held-out source (best measured MFU of the other sources' runs, per chip; fp8_gain): "
          + "; ".join(f"{s}: " + ", ".join(f"{k} {v:.3f}" for k, v in e.items())
                      for s, e in cv.get("envelopes", {}).items()))
    print("intervals (published / predicted, 5%-95% of the held-out residuals per kind): "
          + "; ".join(f"{k} {v['low']:.2f}-{v['high']:.2f} ({v['runs']})" for k, v in cv["intervals"].items()))
    if cv.get("carried"):
        print(
            "carried over, not cross-validated (one source measured the chip; its intervals widened both ways by the "
            "largest factor a held-out prediction of it was off by): "
            + "; ".join(f"{k} {v['factor']:.2f}x ({v['runs']} runs)" for k, v in cv["carried"].items())
        )
    for key, ab in cv.get("ablation", {}).items():
        how = "fitted instead of held at" if ab.get("fitted") else "held instead of fitted, at"
        print(
            f"ablation: {key} {how} {ab['prior']}: cross-validated median |err| {100 * ab['median_abs_error']:.1f}% "
            f"(framework policy {100 * ab['framework_median_abs_error']:.1f}%) vs "
            f"{100 * cv['by_source']['all']['median_abs_error']:.1f}% "
            f"({100 * cv['framework_by_source']['all']['median_abs_error']:.1f}%) fitted"
        )


__all__ = ["GAP", "markdown", "plot", "print_cv"]
