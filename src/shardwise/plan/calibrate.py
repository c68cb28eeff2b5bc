"""Measure this machine for the planner and write a :class:`~shardwise.plan.cluster.ClusterSpec`.

All N local processes measure *at the same time* (after a barrier), so the figures include what
they cost each other: on a CPU box with fewer cores than processes each gets its share.

- Matmul throughput: ``2 n^3`` FLOPs per ``n x n`` matmul, median time per size and dtype, the
  slowest rank's figure (a step waits for the slowest rank).
- Memory bandwidth: a large tensor copy (reads + writes ``2 x bytes``).
- Collectives: :func:`shardwise.observe.collectives.measure_bandwidth` by message size, then a
  least-squares fit of the alpha-beta model ``t = alpha + f(op, n) * bytes / busbw`` per
  collective; the all-reduce fit becomes the spec's intra-node bandwidth and latency (latency per
  ``ceil(log2 n)`` steps, the form :meth:`ClusterSpec.collective_time` uses).
- Fixed cost of parallel layers: one forward + backward of a tiny built-in GPT (too small for
  bandwidth to matter) plain, under TP over all ranks and under FSDP (ZeRO-3 and ZeRO-2); the
  differences per layer / per FSDP unit become ``tp_layer_overhead_s`` and
  ``zero{3,2}_unit_overhead_s`` (dispatch, hooks and collective latency together).
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

from shardwise.plan.cluster import ClusterSpec
from shardwise.observe.collectives import BandwidthRow, bus_factor

DEFAULT_SIZES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20)


@dataclass(frozen=True)
class Calibration:
    world_size: int
    device_type: str
    matmul: dict[str, dict[int, float]]  # dtype -> n -> FLOP/s per process
    memory_bw: float
    overhead_s: float
    dtensor_overhead_s: float
    layer_overheads: dict[str, float]  # tp_layer_s, zero3_unit_s, zero2_unit_s
    solo_matmul: float  # fp32 FLOP/s of the largest size with only rank 0 busy
    collectives: list[BandwidthRow]
    memory_bytes: float


def _slowest(value: float, device: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_matmul(device: Any, dtype: Any, n: int, *, iters: int = 5) -> float:
    """FLOP/s of one process for ``n x n`` matmuls while every rank runs the same (slowest rank)."""
    import torch
    import torch.distributed as dist

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(iters):
        dist.barrier()
        times.append(_time_per_call(lambda: a @ b, device))
    return 2 * n**3 / _slowest(statistics.median(times), device)


def _time_per_call(fn: Any, device: Any, *, window_s: float = 0.05) -> float:
    """Mean seconds per call over a window of at least ``window_s``: long enough that being
    descheduled for a time slice (other processes share the cores) averages out instead of
    dominating a single short timing."""
    calls = 0
    _sync(device)
    start = time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 4 == 0:
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= window_s:
                return elapsed / calls


def measure_overhead(device: Any) -> float:
    """Seconds per tiny operator (dispatch + launch), the fixed cost eager execution pays per op."""
    import torch

    x = torch.ones(8, device=device)
    for _ in range(10):
        x = x + 1
    times = [_time_per_call(lambda: x + 1, device) for _ in range(5)]
    return _slowest(statistics.median(times), device)


def measure_dtensor_overhead(device: Any) -> float:
    """Extra seconds of one DTensor operator over a plain one (sharding propagation and dispatch)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import torch.distributed as dist

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    d = distribute_tensor(torch.ones(8 * dist.get_world_size(), device=device), mesh, [Shard(0)])
    plain = torch.ones(8, device=device)
    for _ in range(10):
        d + 1
    dt = statistics.median(_time_per_call(lambda: d + 1, device) for _ in range(5))
    pt = statistics.median(_time_per_call(lambda: plain + 1, device) for _ in range(5))
    return _slowest(max(dt - pt, 0.0), device)


def _layer_step_seconds(plan_text: str, device: Any, *, layers: int, reps: int = 5, calls: int = 4) -> float:
    """Seconds of one forward + backward of a tiny built-in GPT (``layers`` blocks, hidden 8 per
    rank) under ``plan_text`` ("" for the plain model): every rank calls the same number of times,
    because the sharded model communicates; median of ``reps`` windows, slowest rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize
    from shardwise.plan.plan import Plan

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # GPT returns a view; harmless here
    n = dist.get_world_size()
    cfg = GPTConfig(vocab_size=8 * n, seq_len=8, layers=layers, hidden=8 * n, heads=n)
    ids = torch.zeros(2, cfg.seq_len, dtype=torch.long, device=device)
    if plan_text:
        plan = Plan.parse(plan_text)
        pm = parallelize(GPT(cfg, seed=0).to(device), plan, build_mesh(plan, device.type))
        module, context = pm.module, pm.loss_context
    else:
        import contextlib

        module, context = GPT(cfg, seed=0).to(device), contextlib.nullcontext

    def step() -> None:
        with context():
            out = module(ids)
            F.cross_entropy(out.flatten(0, 1), ids.flatten(0, 1)).backward()

    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            step()
        _sync(device)
        times.append((time.perf_counter() - start) / calls)
    return _slowest(statistics.median(times), device)


def measure_parallel_layer_overheads(device: Any, *, layers: int = 4) -> dict[str, float]:
    """Fixed seconds per transformer layer and forward + backward that tensor parallelism and FSDP
    add, measured on a GPT too small for bandwidth to matter (hidden 8 per rank): the step time
    of the sharded model minus the plain one, divided by the layers (TP over all ranks) or by the
    FSDP units (the blocks and the root). This is the dispatch, hook and collective-latency work
    that per-operator figures undercount (FSDP2's pre/post hooks, DTensor redistribution)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    if n < 2:
        return {"tp_layer_s": 0.0, "zero3_unit_s": 0.0, "zero2_unit_s": 0.0}
    plain = _layer_step_seconds("", device, layers=layers)
    tp = _layer_step_seconds(f"tp={n}", device, layers=layers)
    zero3 = _layer_step_seconds(f"zero=3,dp=1,shard={n}", device, layers=layers)
    zero2 = _layer_step_seconds(f"zero=2,dp=1,shard={n}", device, layers=layers)
    units = layers + 1
    return {"tp_layer_s": max(tp - plain, 0.0) / layers, "zero3_unit_s": max(zero3 - plain, 0.0) / units,
            "zero2_unit_s": max(zero2 - plain, 0.0) / units}


def measure_solo_matmul(device: Any, n: int) -> float:
    """fp32 FLOP/s of rank 0 alone (the others wait at a barrier): a process's speed when it has
    the machine to itself, as a pipeline stage has during the fill and drain."""
    import torch
    import torch.distributed as dist

    a = torch.randn(n, n, device=device)
    value = 0.0
    if dist.get_rank() == 0:
        a @ a
        value = 2 * n**3 / statistics.median(_time_per_call(lambda: a @ a, device) for _ in range(3))
    dist.barrier()
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t.item())


def measure_memory_bw(device: Any, *, nbytes: int = 64 * 2**20, iters: int = 5) -> float:
    import torch
    import torch.distributed as dist

    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / _slowest(statistics.median(times), device)


def calibrate_worker(sizes: list[int], matmul_sizes: list[int], iters: int) -> Calibration:
    """Runs on every rank of a launched group (see :func:`shardwise.launch`)."""
    import torch
    import torch.distributed as dist

    from shardwise.observe.collectives import measure_bandwidth

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        # Measure with the threads a training process gets (torchrun's rule: the cores divided among
        # the local processes); more threads than cores make OpenMP spin and slow small matmuls ~100x.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if device.type == "cuda":
        dtypes["fp16"] = torch.float16
    matmul = {name: {n: measure_matmul(device, dt, n) for n in matmul_sizes} for name, dt in dtypes.items()}
    memory_bw = measure_memory_bw(device)
    overhead = measure_overhead(device)
    dtensor = measure_dtensor_overhead(device)
    layer_overheads = measure_parallel_layer_overheads(device)
    solo = measure_solo_matmul(device, max(matmul_sizes))
    rows = measure_bandwidth(device, list(sizes), iters=iters)
    n = dist.get_world_size()
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / n
    return Calibration(n, device.type, matmul, memory_bw, overhead, dtensor, layer_overheads, solo, rows, memory)


def oversubscription(cal: Calibration) -> float:
    """Processes per core on a CPU host (1 on GPUs, where each process has its own device)."""
    if cal.device_type != "cpu":
        return 1.0
    return max(1.0, cal.world_size / (os.cpu_count() or 1))


def fit_alpha_beta(rows: list[BandwidthRow], op: str, n: int) -> tuple[float, float]:
    """Least-squares ``t = alpha + f * bytes / bw`` over the rows of one collective -> (alpha s, bw B/s)."""
    pts = [(bus_factor(op, n) * r.size_bytes, r.latency_us * 1e-6) for r in rows if r.op == op]
    if len(pts) < 2:
        raise ValueError(f"need two sizes of {op} to fit")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    if slope <= 0:  # noisy tiny sizes only: fall back to the largest message's bandwidth
        x, y = max(pts)
        slope = y / x
    # The latency is what the smallest message costs beyond its bytes: an intercept fitted through
    # large messages is dominated by their noise (and can come out negative).
    x0, y0 = min(pts)
    alpha = max(0.0, y0 - slope * x0)
    denom = sum(x * x for x, _ in pts)
    slope = max(sum(x * (y - alpha) for x, y in pts) / denom, 1e-15) if denom else slope
    return alpha, 1.0 / slope


def to_spec(cal: Calibration, *, name: str | None = None) -> ClusterSpec:
    """The ClusterSpec of a calibration (one node with ``world_size`` devices)."""
    n = cal.world_size
    alpha, bw = fit_alpha_beta(cal.collectives, "all_reduce", n) if n > 1 else (0.0, 1e12)
    steps = max(1, math.ceil(math.log2(max(2, n))))
    peak = {dtype: max(by_size.values()) for dtype, by_size in cal.matmul.items()}
    fits = {op: dict(zip(("alpha_s", "busbw_Bps"), fit_alpha_beta(cal.collectives, op, n)))
            for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast") if n > 1}
    return ClusterSpec(
        name=name or f"calibrated-{socket.gethostname()}-{n}x{cal.device_type}",
        devices=n, devices_per_node=n, memory_bytes=cal.memory_bytes, peak_flops=peak, achievable_fraction=1.0,
        intra_bw=bw, intra_latency_s=alpha / steps, inter_bw=bw, inter_latency_s=alpha / steps, memory_bw=cal.memory_bw,
        kernel_overhead_s=cal.overhead_s,
        dtensor_overhead_s=cal.dtensor_overhead_s,
        tp_layer_overhead_s=cal.layer_overheads["tp_layer_s"],
        zero3_unit_overhead_s=cal.layer_overheads["zero3_unit_s"],
        zero2_unit_overhead_s=cal.layer_overheads["zero2_unit_s"],
        # How much faster one busy process runs than each of N busy ones: > 1 when the processes
        # share fewer cores than there are processes (a pipeline's idle stages then cost nothing).
        # Structural (processes per core), because a measured solo/shared ratio on a machine that
        # other jobs load measures their load; the measured ratio is kept in `measurements`.
        oversubscription=oversubscription(cal),
        # CPU collectives run on the same cores as the compute: nothing hides behind backward.
        overlap=0.0 if cal.device_type == "cpu" else 1.0, device_type=cal.device_type,
        measurements={
            "matmul_flops": {d: {str(k): v for k, v in s.items()} for d, s in cal.matmul.items()},
            "collectives": [r.__dict__ for r in cal.collectives],
            "fits": fits,
            "solo_matmul_flops": cal.solo_matmul,
            "solo_over_shared": cal.solo_matmul / max(cal.matmul["fp32"][max(cal.matmul["fp32"])], 1.0),
        },
    )


def calibrate(nproc: int, *, sizes: tuple[int, ...] = DEFAULT_SIZES, matmul_sizes: tuple[int, ...] = (64, 128, 256, 512, 1024),
              iters: int = 10, name: str | None = None, timeout_s: float = 300.0) -> ClusterSpec:
    """Start ``nproc`` local processes, measure, and return the spec (rank 0's view)."""
    from shardwise.launch.inprocess import launch

    cal = launch(calibrate_worker, nprocs=nproc, args=(list(sizes), list(matmul_sizes), iters), timeout_s=timeout_s)[0]
    return to_spec(cal, name=name)
