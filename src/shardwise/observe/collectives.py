"""Check and time the collectives every training job depends on.

Run on every rank of an initialized process group. Each collective is checked for the right
values first (a wrong sum is a broken fabric, not a slow one), then timed by message size.

Bandwidth follows nccl-tests: algorithm bandwidth ``algbw = bytes / time``, bus bandwidth
``busbw = algbw * f`` with ``f = 2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather and
reduce_scatter and ``1`` for broadcast, so that busbw is comparable with the link's peak whatever n.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")


@dataclass(frozen=True)
class CheckResult:
    op: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class BandwidthRow:
    op: str
    size_bytes: int
    latency_us: float
    algbw_gbps: float
    busbw_gbps: float


def bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(op, 1.0)


def _run_op(op: str, numel: int, device: torch.device) -> Callable[[], None]:
    """A closure that runs one collective of ``numel`` float32 elements in total."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if op == "all_reduce":
        t = torch.full((numel,), float(rank + 1), device=device)
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        t = torch.full((numel,), float(rank), device=device)
        return lambda: dist.broadcast(t, src=0)
    shard = max(1, numel // n)
    if op == "all_gather":
        src = torch.full((shard,), float(rank), device=device)
        out = [torch.empty(shard, device=device) for _ in range(n)]
        return lambda: dist.all_gather(out, src)
    if op == "reduce_scatter":
        ins = [torch.full((shard,), float(rank + 1), device=device) for _ in range(n)]
        out = torch.empty(shard, device=device)
        return lambda: dist.reduce_scatter(out, ins)
    return lambda: dist.barrier()


def check_values(device: torch.device) -> list[CheckResult]:
    """Run each collective once on small tensors and compare with the known answer."""
    n, rank = dist.get_world_size(), dist.get_rank()
    results = []
    expected_sum = n * (n + 1) / 2

    t = torch.full((8,), float(rank + 1), device=device)
    dist.all_reduce(t)
    results.append(
        CheckResult("all_reduce", bool(torch.all(t == expected_sum)), f"sum {t[0].item()} != {expected_sum}")
    )

    t = torch.full((8,), 42.0 if rank == 0 else -1.0, device=device)
    dist.broadcast(t, src=0)
    results.append(CheckResult("broadcast", bool(torch.all(t == 42.0)), f"got {t[0].item()} != 42"))

    out = [torch.empty(4, device=device) for _ in range(n)]
    dist.all_gather(out, torch.full((4,), float(rank), device=device))
    ok = all(bool(torch.all(o == r)) for r, o in enumerate(out))
    results.append(CheckResult("all_gather", ok, f"got {[o[0].item() for o in out]}"))

    rs = torch.empty(4, device=device)
    dist.reduce_scatter(rs, [torch.full((4,), float(rank + 1), device=device) for _ in range(n)])
    results.append(
        CheckResult("reduce_scatter", bool(torch.all(rs == expected_sum)), f"got {rs[0].item()} != {expected_sum}")
    )

    dist.barrier()
    results.append(CheckResult("barrier", True))
    # Every rank must agree: a check that fails anywhere fails everywhere.
    flags = torch.tensor([0.0 if r.ok else 1.0 for r in results], device=device)
    dist.all_reduce(flags)
    return [
        CheckResult(r.op, flag.item() == 0, "" if flag.item() == 0 else r.detail) for r, flag in zip(results, flags)
    ]


def measure_bandwidth(
    device: torch.device, sizes: list[int], *, warmup: int = 3, iters: int = 10
) -> list[BandwidthRow]:
    """Median time per collective at each message size (bytes), the slowest rank's view."""
    n = dist.get_world_size()
    rows = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        for size in sizes:
            step = _run_op(op, max(1, size // 4), device)
            for _ in range(warmup):
                step()
            times = []
            for _ in range(iters):
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(median, op=dist.ReduceOp.MAX)
            seconds = median.item()
            algbw = size / seconds / 1e9
            rows.append(BandwidthRow(op, size, seconds * 1e6, algbw, algbw * bus_factor(op, n)))
    return rows


def format_table(rows: list[BandwidthRow]) -> str:
    lines = [f"{'collective':<15}{'size':>10}{'latency (us)':>15}{'algbw (GB/s)':>15}{'busbw (GB/s)':>15}"]
    for r in rows:
        lines.append(f"{r.op:<15}{_human(r.size_bytes):>10}{r.latency_us:>15.1f}{r.algbw_gbps:>15.3f}{r.busbw_gbps:>15.3f}")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
