"""Timing that holds up when several processes share the cores: *concurrent windows*.

The ranks agree on a call count long enough to span many scheduler time slices, start together
after a barrier, and the slowest rank's elapsed time over that count is the answer (median of a
few windows). Short per-rank timings would let a rank that runs while the others are descheduled
report a speed no training step ever sees. Used by :mod:`shardwise.calibrate.calibration` and
:mod:`shardwise.calibrate.layer_costs`; every function is a collective call (all ranks).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Windows:
    """How long each figure is timed: every call site's window times ``scale``, and the median of
    at most ``count`` windows. ``QUICK`` (``shardwise calibrate --quick``) takes one window a third
    as long: a first look in a few seconds, noisier by the scheduler's slices it no longer spans."""

    scale: float = 1.0
    count: int = 3


FULL, QUICK = Windows(), Windows(scale=1 / 3, count=1)


def slowest(value: float, device: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def concurrent_seconds(
    fn: Any, device: Any, *, window_s: float = 0.15, windows: int = 3, timing: Windows = FULL
) -> float:
    """Seconds per call of ``fn`` while every rank runs it (see the module doc): per window, the
    ranks agree on a call count ``k`` (``window_s`` at the fastest rank's probed pace), start after
    a barrier and report the slowest rank's elapsed / ``k``; the median over ``windows``
    (both as ``timing`` scales them)."""
    import torch.distributed as dist

    window_s, windows = window_s * timing.scale, min(windows, timing.count)

    fn()
    sync(device)
    start = time.perf_counter()
    fn()
    fn()
    sync(device)
    probe = max((time.perf_counter() - start) / 2, 1e-7)
    calls = int(slowest(float(max(2, math.ceil(window_s / probe))), device))  # the same count on every rank
    out = []
    for _ in range(windows):
        dist.barrier()
        sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        out.append(slowest((time.perf_counter() - start) / calls, device))
    return statistics.median(out)


def solo_seconds(fn: Any, device: Any, *, window_s: float = 0.15, windows: int = 3, timing: Windows = FULL) -> float:
    """Seconds per call of ``fn`` on rank 0 while the other ranks wait in a barrier (broadcast)."""
    import torch
    import torch.distributed as dist

    window_s, windows = window_s * timing.scale, min(windows, timing.count)

    value = 0.0
    if dist.get_rank() == 0:
        fn()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        calls = max(2, math.ceil(window_s / max(time.perf_counter() - start, 1e-7)))
        runs = []
        for _ in range(windows):
            sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync(device)
            runs.append((time.perf_counter() - start) / calls)
        value = statistics.median(runs)
    dist.barrier()
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t.item())
