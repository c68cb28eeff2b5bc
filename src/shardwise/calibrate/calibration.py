"""Measure this machine for the planner and write a :class:`~shardwise.plan.cluster.ClusterSpec`.

All N local processes measure *at the same time*, so the figures include what they cost each
other: on a CPU box with fewer cores than processes each gets its share. Each figure is a
*concurrent window*: the ranks agree on a call count long enough to span many scheduler time
slices (0.15 s at the fastest rank's pace), start together after a barrier, and the slowest rank's
elapsed time over that count is the answer (median of three windows; ``--quick``: one window a
third as long, :data:`~shardwise.calibrate.timing.QUICK`). Short per-rank timings
would let a rank that happens to run while the others are descheduled report a speed no step
ever sees.

- Matmul throughput: ``2 n^3`` FLOPs per ``n x n`` matmul by size and dtype (sizes up to 1024 on a
  CPU, up to 8192 on a GPU, where small matmuls reach a small fraction of the peak).
- Oversubscription: the same fp32 matmul on rank 0 alone (the others wait in a barrier, which
  costs no CPU) over the concurrent figure: how much faster a lone busy process runs, which is
  what a pipeline stage gains while the others idle. Measured, so that a host that other jobs
  load (where idle stages do *not* free cores for ours) gets a smaller figure than processes per
  core. It is also measured as the pipelining runtime gets it (:func:`measure_pipeline_overlap`:
  every rank a stage with a real block, hand-off latencies included), and the smaller figure wins.
- Transformer-layer throughput: forward + backward of a stack of the built-in GPT's blocks at a
  few widths, per precision, plain and under full recomputation: what real layers achieve
  (attention, norms, activation functions and autograd included), which small or eager layers get
  far below the matmul figure.
- Optimizer: Adam's step per parameter tensor (plain and DTensor) and per element.
- Memory bandwidth: a large tensor copy (reads + writes ``2 x bytes``).
- Collectives: :func:`shardwise.observe.collectives.measure_bandwidth` by message size, then a
  least-squares fit of the alpha-beta model ``t = alpha + f(op, n) * bytes / busbw`` per
  collective; the all-reduce fit becomes the spec's intra-node bandwidth and latency (latency per
  ``ceil(log2 n)`` steps, the form :meth:`ClusterSpec.collective_time` uses).
- Fixed cost of parallel layers: one forward + backward of a tiny built-in GPT (too small for
  bandwidth to matter) plain, under TP over all ranks and under FSDP (ZeRO-3 and ZeRO-2); the
  differences per layer / per FSDP unit become ``tp_layer_overhead_s`` and
  ``zero{3,2}_unit_overhead_s`` (dispatch, hooks and collective latency together). For pipelines,
  the tiny GPT with every rank a stage (at most 8) and ``p`` and ``2p`` microbatches: one more
  microbatch adds one slot to the critical path, so the difference per microbatch minus a stage's
  own compute is ``pp_microbatch_overhead_s`` (the schedule's Python work, point-to-point latency,
  shape checks).

The model-level measurements (layers, pipelines, Adam) live in :mod:`shardwise.calibrate.layer_costs`,
the concurrent windows in :mod:`shardwise.calibrate.timing`.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Any

from shardwise.observe.collectives import BandwidthRow, bus_factor
from shardwise.plan.cluster import ClusterSpec
from shardwise.calibrate.layer_costs import (
    measure_block_throughput,
    measure_optimizer,
    measure_parallel_layer_overheads,
    measure_pipeline_overlap,
)
from shardwise.calibrate.timing import FULL, QUICK, Windows, concurrent_seconds, solo_seconds

DEFAULT_SIZES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20)


@dataclass(frozen=True)
class Calibration:
    world_size: int
    device_type: str
    matmul: dict[str, dict[int, float]]  # dtype -> n -> FLOP/s per process
    memory_bw: float
    overhead_s: float
    dtensor_overhead_s: float
    layer_overheads: dict[str, float]  # tp_layer_s, zero3_unit_s, zero2_unit_s, pp_microbatch_s
    block_flops: dict[str, dict[str, float]]  # precision -> GEMM dimension -> FLOP/s of a transformer layer
    optimizer: dict[str, float]  # Adam: tensor_s, dtensor_tensor_s, param_s
    solo_matmul: float  # fp32 FLOP/s of the largest size with only rank 0 busy
    collectives: list[BandwidthRow]
    memory_bytes: float
    threads: int = 1  # intra-op threads per process while measuring


def measure_matmul(device: Any, dtype: Any, n: int, timing: Windows = FULL) -> float:
    """FLOP/s of one process for ``n x n`` matmuls while every rank runs the same (concurrent window)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / concurrent_seconds(lambda: a @ b, device, timing=timing)


def measure_overhead(device: Any, timing: Windows = FULL) -> float:
    """Seconds per tiny operator (dispatch + launch), the fixed cost eager execution pays per op."""
    import torch

    x = torch.ones(8, device=device)
    return concurrent_seconds(lambda: x + 1, device, window_s=0.05, timing=timing)


def measure_dtensor_overhead(device: Any, timing: Windows = FULL) -> float:
    """Extra seconds of one DTensor operator over a plain one (sharding propagation and dispatch)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import torch.distributed as dist

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    d = distribute_tensor(torch.ones(8 * dist.get_world_size(), device=device), mesh, [Shard(0)])
    plain = torch.ones(8, device=device)
    dt = concurrent_seconds(lambda: d + 1, device, window_s=0.05, timing=timing)
    pt = concurrent_seconds(lambda: plain + 1, device, window_s=0.05, timing=timing)
    return max(dt - pt, 0.0)


def measure_solo_matmul(device: Any, n: int, timing: Windows = FULL) -> float:
    """fp32 FLOP/s of rank 0 alone (the others wait at a barrier): a process's speed when it has
    the machine to itself, as a pipeline stage has during the fill and drain."""
    import torch

    a = torch.randn(n, n, device=device)
    return 2 * n**3 / solo_seconds(lambda: a @ a, device, timing=timing)


# (hidden, tokens per microbatch, sequence length) of the reference transformer layers: small on a
# CPU, GPT-2 to GPT-3-13B widths on a GPU.
def measure_memory_bw(device: Any, *, nbytes: int = 64 * 2**20, timing: Windows = FULL) -> float:
    """Bytes per second of a large copy (read + write) while every rank copies."""
    import torch

    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / concurrent_seconds(lambda: dst.copy_(src), device, window_s=0.1, timing=timing)


CPU_MATMUL_SIZES = (64, 128, 256, 512, 1024)
GPU_MATMUL_SIZES = (256, 1024, 4096, 8192)
# `shardwise calibrate --quick`: the smaller matmuls and the narrower transformer layers only
QUICK_MATMUL_SIZES, QUICK_BLOCK_WIDTHS = 3, 2


def calibrate_worker(
    sizes: list[int], matmul_sizes: list[int] | None, iters: int, *, quick: bool = False
) -> Calibration:
    """Runs on every rank of an initialized group: a group started by :func:`calibrate`, or a
    training job's own world (``Trainer(plan="auto")``). It measures with the intra-op threads the
    process already has (``shardwise run`` gives each local process the cores divided among them),
    because that is what training will get; ``matmul_sizes`` None: the device's default sizes.
    ``quick``: the same measurements at fewer sizes (the smaller default matmuls, the narrower
    transformer layers), each timed in one shorter window (:data:`~shardwise.calibrate.timing.QUICK`):
    a first look in a fraction of the time, with lower peaks, noisier figures and a shorter table of
    layer throughputs for the planner to interpolate."""
    import torch
    import torch.distributed as dist

    from shardwise.observe.collectives import measure_bandwidth

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if matmul_sizes is None:
        matmul_sizes = list(GPU_MATMUL_SIZES if device.type == "cuda" else CPU_MATMUL_SIZES)[
            : QUICK_MATMUL_SIZES if quick else None
        ]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if device.type == "cuda":
        dtypes["fp16"] = torch.float16
    timing = QUICK if quick else FULL
    matmul = {name: {n: measure_matmul(device, dt, n, timing) for n in matmul_sizes} for name, dt in dtypes.items()}
    memory_bw = measure_memory_bw(device, timing=timing)
    overhead = measure_overhead(device, timing)
    dtensor = measure_dtensor_overhead(device, timing)
    layer_overheads = measure_parallel_layer_overheads(device, timing=timing)
    widths = QUICK_BLOCK_WIDTHS if quick else None
    block = measure_block_throughput(device, ("fp32", "bf16"), widths=widths, timing=timing)
    optimizer = measure_optimizer(device, timing)
    solo = measure_solo_matmul(device, max(matmul_sizes), timing)
    slot_s = layer_overheads.get("pp_microbatch_s", 0.0)
    layer_overheads["pipeline_overlap"] = measure_pipeline_overlap(device, slot_s, timing)
    rows = measure_bandwidth(device, list(sizes), iters=iters)
    n = dist.get_world_size()
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / n
    return Calibration(
        n,
        device.type,
        matmul,
        memory_bw,
        overhead,
        dtensor,
        layer_overheads,
        block,
        optimizer,
        solo,
        rows,
        memory,
        threads=torch.get_num_threads(),
    )


def oversubscription(cal: Calibration) -> float:
    """How much faster one busy process runs than each of N busy ones (1 on GPUs, where each process
    has its own device): the measured solo / concurrent fp32 matmul ratio, at most the processes per
    core times the threads that a lone process can use. On an idle host with more processes than
    cores this is the processes per core (a pipeline's idle stages free their cores for the busy
    ones); on a host that other jobs load the measured ratio is smaller, because the cores an idle
    stage frees go to those jobs as much as to ours."""
    if cal.device_type != "cpu":
        return 1.0
    cores = os.cpu_count() or 1
    ceiling = min(cal.threads, cores) / min(cal.threads, cores / cal.world_size)  # lone vs all-busy cores per process
    measured = cal.solo_matmul / max(cal.matmul["fp32"][max(cal.matmul["fp32"])], 1.0)
    piped = cal.layer_overheads.get("pipeline_overlap", 0.0)
    if piped > 0:
        measured = min(measured, piped)
    return min(max(1.0, measured), max(1.0, ceiling))


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
        pp_microbatch_overhead_s=cal.layer_overheads.get("pp_microbatch_s", 0.0),
        optimizer_tensor_s=cal.optimizer["tensor_s"], optimizer_dtensor_tensor_s=cal.optimizer["dtensor_tensor_s"],
        optimizer_param_s=cal.optimizer["param_s"],
        oversubscription=oversubscription(cal),
        # CPU collectives run on the same cores as the compute: nothing hides behind backward.
        overlap=0.0 if cal.device_type == "cpu" else 1.0, device_type=cal.device_type,
        measurements={
            "matmul_flops": {d: {str(k): v for k, v in s.items()} for d, s in cal.matmul.items()},
            "block_flops": cal.block_flops,
            "collectives": [r.__dict__ for r in cal.collectives],
            "fits": fits,
            "solo_matmul_flops": cal.solo_matmul,
            "solo_over_shared": cal.solo_matmul / max(cal.matmul["fp32"][max(cal.matmul["fp32"])], 1.0),
            "threads_per_process": cal.threads, "cpu_count": os.cpu_count() or 1,
            "pipeline_overlap": cal.layer_overheads.get("pipeline_overlap", 0.0),
        },
    )


def _calibrate_with_threads(
    threads: int, sizes: list[int], matmul_sizes: list[int] | None, iters: int, quick: bool = False
) -> Calibration:
    """A CPU worker of :func:`calibrate` with ``shardwise run``'s thread rule (cores / local processes):
    more threads than cores make OpenMP spin and slow small matmuls ~100x."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(threads)
    return calibrate_worker(sizes, matmul_sizes, iters, quick=quick)


def calibrate(nproc: int, *, sizes: tuple[int, ...] = DEFAULT_SIZES, matmul_sizes: tuple[int, ...] | None = None,
              iters: int = 10, name: str | None = None, timeout_s: float = 300.0, quick: bool = False) -> ClusterSpec:
    """Start ``nproc`` local processes (each with the cores divided among them, as ``shardwise run``
    gives), measure, and return the spec (rank 0's view); ``quick``: see :func:`calibrate_worker`."""
    from shardwise.launch.inprocess import launch

    sizes_arg = list(matmul_sizes) if matmul_sizes is not None else None
    threads = max(1, (os.cpu_count() or 1) // nproc)
    cal = launch(
        _calibrate_with_threads, nprocs=nproc, args=(threads, list(sizes), sizes_arg, iters, quick), timeout_s=timeout_s
    )[0]
    return to_spec(cal, name=name)
