"""Deep profile on demand: a window of steps under ``torch.profiler``, one trace per rank.

:class:`DeepProfiler` records ``active`` steps after ``skip`` steps (plus ``warmup`` steps that are
profiled but thrown away, as torch's schedule does) and then writes, per rank:

- ``trace_rank{r}.json``: a Chrome trace (open in https://ui.perfetto.dev or ``chrome://tracing``);
- ``summary_rank{r}.txt``: the top operators by self time (``key_averages``) and the communication
  overlap: of the time collectives were in flight, the share during which computation ran.

Overlap arithmetic: ``comm`` is the union of the intervals of communication events (names with
``nccl``, ``gloo``, ``c10d`` or a collective's name); ``compute`` is the union of the other operator
intervals (``aten::`` ops on the CPU; kernels on the GPU) that are not nested inside a communication
event on the same thread (a thread blocked in ``wait`` is not computing). ``overlap = |comm ∩
compute| / |comm|``: 0 means every collective was exposed, 1 means all of them were hidden.

This is the expensive, honest view (the profiler costs several percent to tens of percent); the
cheap always-on breakdown is :mod:`shardwise.observe.profiler`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_COMM = re.compile(r"nccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all|alltoall", re.I)


@dataclass(frozen=True)
class DeepProfileResult:
    rank: int
    trace_path: str
    summary_path: str
    top_ops: str
    comm_s: float
    overlapped_s: float

    @property
    def overlap_fraction(self) -> float:
        return self.overlapped_s / self.comm_s if self.comm_s > 0 else 0.0


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_overlap(events: list[Any]) -> tuple[float, float]:
    """``(comm seconds, overlapped seconds)`` from profiler ``FunctionEvent``s (see the module doc)."""
    comm, others = [], []
    for e in events:
        a, b = e.time_range.start / 1e6, e.time_range.end / 1e6
        if b <= a:
            continue
        if _COMM.search(e.name):
            comm.append((a, b, e.thread))
        elif e.name.startswith("aten::") or getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            others.append((a, b, e.thread))
    comm_by_thread: dict[int, list[tuple[float, float]]] = {}
    for a, b, t in comm:
        comm_by_thread.setdefault(t, []).append((a, b))
    compute = [(a, b) for a, b, t in others
               if not any(ca <= a and b <= cb for ca, cb in comm_by_thread.get(t, ()))]
    comm_u, compute_u = _union([(a, b) for a, b, _ in comm]), _union(compute)
    return _length(comm_u), _intersect(comm_u, compute_u)


class DeepProfiler:
    """``torch.profiler`` over a window of steps; call :meth:`step` once per training step."""

    def __init__(self, out_dir: str | os.PathLike, *, skip: int = 2, warmup: int = 1, active: int = 3, top: int = 15,
                 record_shapes: bool = False, with_stack: bool = False) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.out_dir, self.top = str(out_dir), top
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.result: DeepProfileResult | None = None
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=skip, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._ready,
            record_shapes=record_shapes,
            with_stack=with_stack,
        )
        self._running = False

    def start(self) -> "DeepProfiler":
        self._prof.start()
        self._running = True
        return self

    def step(self) -> None:
        if self._running:
            self._prof.step()

    def stop(self) -> DeepProfileResult | None:
        if self._running:
            self._prof.stop()
            self._running = False
        return self.result

    def __enter__(self) -> "DeepProfiler":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _ready(self, prof: Any) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        trace = os.path.join(self.out_dir, f"trace_rank{self.rank}.json")
        prof.export_chrome_trace(trace)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=self.top)
        comm_s, overlapped_s = comm_overlap(list(prof.events()))
        summary = os.path.join(self.out_dir, f"summary_rank{self.rank}.txt")
        frac = overlapped_s / comm_s if comm_s > 0 else 0.0
        with open(summary, "w") as f:
            f.write(f"rank {self.rank}: top {self.top} operators by self time\n{table}\n")
            f.write(
                f"communication in flight: {comm_s * 1e3:.2f} ms; overlapped with compute: {overlapped_s * 1e3:.2f} ms "
                f"({frac:.0%}); exposed: {(comm_s - overlapped_s) * 1e3:.2f} ms\n"
            )
        self.result = DeepProfileResult(self.rank, trace, summary, table, comm_s, overlapped_s)
