"""Pictures of where the time went: per-rank timelines, pipeline schedules, bandwidth curves (PNG).

- :func:`plot_timeline`: one lane per rank, consecutive steps left to right, coloured by what the
  rank was doing (data, forward, backward, optimizer, communication); the uncoloured gaps are idle.
  Each rank's lane starts at its own first step (clocks of different hosts are not comparable;
  the collectives keep the ranks' steps aligned anyway).
- :func:`plot_pipeline_schedule`: one lane per pipeline stage, a box per microbatch forward (F),
  backward (B) or weight-gradient (W) pass, labelled with the microbatch number; the white space is
  the pipeline bubble, whose fraction ``1 - busy / (stages * makespan)`` is in the title.
- :func:`plot_bandwidth`: ``shardwise doctor``'s bus bandwidth against message size.

Matplotlib's ``Agg`` backend: no display needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from shardwise.errors import ConfigError
from shardwise.observe.profiler import StepTimes

COLORS = {"data": "#9e9e9e", "forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b2", "comm": "#c44e52",
          "F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def check_plot_format(path: str, *, option: str) -> None:
    """Refuse a file name whose extension matplotlib cannot write, before the work to plot is done
    (savefig would fail at the end, or write ``<path>.png`` where none was asked)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in formats:
        raise ConfigError(f"{option} {path}: {'.' + extension if extension else 'no extension'} is not a plot format",
                          hint=f"end the name with one of: {', '.join('.' + f for f in sorted(formats))}")


def _save(fig: Any, path: str | os.PathLike) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return str(path)


def plot_timeline(
    records_by_rank: dict[int, Sequence[StepTimes]], path: str | os.PathLike, *, title: str | None = None
) -> str:
    """Per-rank compute / communication / idle bars over consecutive steps (see the module doc)."""
    plt = _pyplot()
    ranks = sorted(records_by_rank)
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(ranks) + 1.6))
    for lane, rank in enumerate(ranks):
        recs = list(records_by_rank[rank])
        if not recs:
            continue
        origin = recs[0].start
        ax.broken_barh(
            [(r.start - origin, r.total_s) for r in recs], (lane - 0.4, 0.8), facecolors="#f2f2f2", edgecolor="#bbbbbb"
        )
        for r in recs:
            for kind in COLORS:
                bars = [(r.start - origin + a, b - a) for k, a, b in r.segments if k == kind]
                if bars:
                    ax.broken_barh(
                        bars,
                        (lane - 0.35 if kind != "comm" else lane - 0.15, 0.7 if kind != "comm" else 0.3),
                        facecolors=COLORS[kind],
                    )
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel("seconds since the first step shown (idle: light grey)")
    ax.invert_yaxis()
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("data", "forward", "backward", "optimizer", "comm")
    ]
    ax.legend(handles, ["data", "forward", "backward", "optimizer", "communication"], loc="upper center",
              bbox_to_anchor=(0.5, -0.18 if len(ranks) > 2 else -0.35), ncol=5, frameon=False)
    ax.set_title(title or "per-rank step timeline")
    return _save(fig, path)


@dataclass(frozen=True)
class PipelineEvent:
    """One pass of one microbatch on one stage, in seconds (or schedule slots)."""

    stage: int
    microbatch: int
    kind: str  # F | B | W
    start: float
    end: float


def bubble_fraction(events: Iterable[PipelineEvent]) -> float:
    """``1 - busy / (stages * makespan)``: the share of stage-time spent waiting."""
    evs = list(events)
    if not evs:
        return 0.0
    stages = len({e.stage for e in evs})
    t0, t1 = min(e.start for e in evs), max(e.end for e in evs)
    busy = sum(e.end - e.start for e in evs)
    return max(0.0, 1.0 - busy / (stages * (t1 - t0))) if t1 > t0 else 0.0


def events_from_pipeline_order(order: dict[int, Sequence[Any]]) -> list[PipelineEvent]:
    """Unit-time events from a torch pipeline schedule's ``pipeline_order`` (rank -> actions or None).

    Each action has ``stage_index``, ``computation_type`` (FORWARD, BACKWARD_INPUT/FULL_BACKWARD,
    BACKWARD_WEIGHT) and ``microbatch_index``; ``None`` is an idle slot.
    """
    out = []
    for _rank, actions in sorted(order.items()):
        for slot, action in enumerate(actions):
            if action is None:
                continue
            ctype = str(getattr(action.computation_type, "name", action.computation_type)).upper()
            kind = "F" if ctype in ("F", "FORWARD") else "W" if ctype in ("W", "BACKWARD_WEIGHT") else "B"
            out.append(
                PipelineEvent(int(action.stage_index), int(action.microbatch_index), kind, float(slot), float(slot + 1))
            )
    return out


def plot_pipeline_schedule(events: Sequence[PipelineEvent], path: str | os.PathLike, *, title: str | None = None,
                           unit: str = "s") -> str:
    """Which microbatch each stage runs when, forward and backward (see the module doc)."""
    plt = _pyplot()
    stages = sorted({e.stage for e in events})
    t0 = min((e.start for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(stages) + 1.6))
    for e in events:
        lane = stages.index(e.stage)
        ax.broken_barh([(e.start - t0, e.end - e.start)], (lane - 0.4, 0.8), facecolors=COLORS.get(e.kind, "#999999"),
                       edgecolor="white")
        ax.text(e.start - t0 + (e.end - e.start) / 2, lane, f"{e.kind}{e.microbatch}", ha="center", va="center",
                color="white", fontsize=7)
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    frac = bubble_fraction(events)
    ax.set_title(f"{title or 'pipeline schedule'} — bubble {frac:.0%}")
    return _save(fig, path)


def plot_bandwidth(rows: Sequence[Any], path: str | os.PathLike, *, title: str | None = None) -> str:
    """Bus bandwidth (GB/s) against message size, one line per collective (rows: ``BandwidthRow``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for op in dict.fromkeys(r.op for r in rows):
        pts = sorted((r.size_bytes, r.busbw_gbps) for r in rows if r.op == op)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title or "collective bandwidth")
    return _save(fig, path)
