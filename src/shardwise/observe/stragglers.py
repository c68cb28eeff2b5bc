"""Find the slow rank: compare the step profiler's summaries across ranks at the logging interval.

In synchronous training every rank's *wall-clock* step is as long as the slowest rank's, because
the fast ones wait for it inside the next collective. So ranks are compared on their **busy time**:
the step minus the time blocked in collectives (``StepTimes.busy_s``). A rank whose busy time
exceeds the median over ranks by more than ``threshold`` (relative) and ``min_excess_s`` (absolute,
so microsecond noise on tiny steps is not a finding) is a straggler. What it was slow at is the
phase (data, forward, backward, optimizer, idle) whose time exceeds that phase's median by the
most. The fast ranks show the mirror image: a long ``comm`` time spent waiting for it.

Communication: one ``all_gather_object`` of a small summary per logging interval, on every rank.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass, field
from typing import Iterable

import torch.distributed as dist

from shardwise.observe.profiler import CommSplit, StepTimes

_PARTS = ("data", "forward", "backward", "optimizer", "idle")


@dataclass(frozen=True)
class RankSummary(CommSplit):
    """Mean seconds per step over a window of steps, on one rank."""

    rank: int
    host: str
    steps: int
    step_s: float
    data_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    idle_s: float
    comm_s: dict = field(default_factory=dict)

    @property
    def span_s(self) -> float:
        return self.step_s

    def part(self, name: str) -> float:
        return getattr(self, f"{name}_s")


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    busy_s: float
    median_busy_s: float
    slow_at: str  # the phase with the largest excess over its median
    slow_at_excess_s: float

    def describe(self) -> str:
        return (f"rank {self.rank} on {self.host} is a straggler: busy {self.busy_s * 1e3:.1f} ms/step vs a median of "
                f"{self.median_busy_s * 1e3:.1f} ms ({self.busy_s / max(self.median_busy_s, 1e-12):.2f}x); slow at "
                f"{self.slow_at} (+{self.slow_at_excess_s * 1e3:.1f} ms/step over the median rank)")


def summarize(records: Iterable[StepTimes], *, rank: int, host: str | None = None) -> RankSummary:
    """Mean per-step breakdown of ``records`` (empty: all zeros)."""
    recs = list(records)
    n = max(1, len(recs))
    comm: dict[str, float] = {}
    for r in recs:
        for op, s in r.comm_s.items():
            comm[op] = comm.get(op, 0.0) + s / n
    return RankSummary(
        rank=rank, host=host or socket.gethostname(), steps=len(recs),
        step_s=sum(r.total_s for r in recs) / n, data_s=sum(r.data_s for r in recs) / n,
        forward_s=sum(r.forward_s for r in recs) / n, backward_s=sum(r.backward_s for r in recs) / n,
        optimizer_s=sum(r.optimizer_s for r in recs) / n, idle_s=sum(r.idle_s for r in recs) / n, comm_s=comm,
    )


def find_stragglers(
    summaries: list[RankSummary], *, threshold: float = 0.2, min_excess_s: float = 1e-3
) -> list[Straggler]:
    """Ranks whose busy time exceeds the median by ``threshold`` (relative) and ``min_excess_s`` (see module doc)."""
    if len(summaries) < 2:
        return []
    median_busy = statistics.median(s.busy_s for s in summaries)
    medians = {p: statistics.median(s.part(p) for s in summaries) for p in _PARTS}
    out = []
    for s in summaries:
        excess = s.busy_s - median_busy
        if excess > threshold * median_busy and excess > min_excess_s:
            slow_at = max(_PARTS, key=lambda p: s.part(p) - medians[p])
            out.append(Straggler(s.rank, s.host, s.busy_s, median_busy, slow_at, s.part(slow_at) - medians[slow_at]))
    return sorted(out, key=lambda x: -x.busy_s)


def gather_summaries(summary: RankSummary, group: dist.ProcessGroup | None = None) -> list[RankSummary]:
    """Every rank's summary, on every rank (one ``all_gather_object``; collective: all ranks must call it)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [summary]
    out: list[RankSummary | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, summary, group=group)
    return sorted((s for s in out if s is not None), key=lambda s: s.rank)


def format_table(summaries: list[RankSummary]) -> str:
    """Per-rank table in ms/step: step, data, forward, backward, optimizer, comm (by op), idle."""
    ops = sorted({op for s in summaries for op in s.comm_s})
    head = (
        f"{'rank':>4} {'host':<12}{'step':>9}{'busy':>9}"
        + "".join(f"{p:>10}" for p in _PARTS)
        + "".join(f"{op[:14]:>15}" for op in ops)
    )
    lines = [head + "   (ms/step)"]
    for s in summaries:
        lines.append(f"{s.rank:>4} {s.host[:12]:<12}{s.step_s * 1e3:>9.2f}{s.busy_s * 1e3:>9.2f}"
                     + "".join(f"{s.part(p) * 1e3:>10.2f}" for p in _PARTS)
                     + "".join(f"{s.comm_s.get(op, 0.0) * 1e3:>15.2f}" for op in ops))
    return "\n".join(lines)
