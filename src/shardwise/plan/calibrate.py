"""Measure this machine for the planner and write a :class:`~shardwise.plan.cluster.ClusterSpec`.

All N local processes measure *at the same time*, so the figures include what they cost each
other: on a CPU box with fewer cores than processes each gets its share. Each figure is a
*concurrent window*: the ranks agree on a call count long enough to span many scheduler time
slices (0.15 s at the fastest rank's pace), start together after a barrier, and the slowest rank's
elapsed time over that count is the answer (median of three windows). Short per-rank timings
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
    layer_overheads: dict[str, float]  # tp_layer_s, zero3_unit_s, zero2_unit_s, pp_microbatch_s
    block_flops: dict[str, dict[str, float]]  # precision -> GEMM dimension -> FLOP/s of a transformer layer
    optimizer: dict[str, float]  # Adam: tensor_s, dtensor_tensor_s, param_s
    solo_matmul: float  # fp32 FLOP/s of the largest size with only rank 0 busy
    collectives: list[BandwidthRow]
    memory_bytes: float
    threads: int = 1  # intra-op threads per process while measuring


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


def concurrent_seconds(fn: Any, device: Any, *, window_s: float = 0.15, windows: int = 3) -> float:
    """Seconds per call of ``fn`` while every rank runs it (see the module doc): per window, the
    ranks agree on a call count ``k`` (``window_s`` at the fastest rank's probed pace), start after
    a barrier and report the slowest rank's elapsed / ``k``; the median over ``windows``."""
    import torch.distributed as dist

    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    fn()
    _sync(device)
    probe = max((time.perf_counter() - start) / 2, 1e-7)
    calls = int(_slowest(float(max(2, math.ceil(window_s / probe))), device))  # the same count on every rank
    out = []
    for _ in range(windows):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        out.append(_slowest((time.perf_counter() - start) / calls, device))
    return statistics.median(out)


def solo_seconds(fn: Any, device: Any, *, window_s: float = 0.15, windows: int = 3) -> float:
    """Seconds per call of ``fn`` on rank 0 while the other ranks wait in a barrier (broadcast)."""
    import torch
    import torch.distributed as dist

    value = 0.0
    if dist.get_rank() == 0:
        fn()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        calls = max(2, math.ceil(window_s / max(time.perf_counter() - start, 1e-7)))
        runs = []
        for _ in range(windows):
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            runs.append((time.perf_counter() - start) / calls)
        value = statistics.median(runs)
    dist.barrier()
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t.item())


def measure_matmul(device: Any, dtype: Any, n: int) -> float:
    """FLOP/s of one process for ``n x n`` matmuls while every rank runs the same (concurrent window)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / concurrent_seconds(lambda: a @ b, device)


def measure_overhead(device: Any) -> float:
    """Seconds per tiny operator (dispatch + launch), the fixed cost eager execution pays per op."""
    import torch

    x = torch.ones(8, device=device)
    return concurrent_seconds(lambda: x + 1, device, window_s=0.05)


def measure_dtensor_overhead(device: Any) -> float:
    """Extra seconds of one DTensor operator over a plain one (sharding propagation and dispatch)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import torch.distributed as dist

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    d = distribute_tensor(torch.ones(8 * dist.get_world_size(), device=device), mesh, [Shard(0)])
    plain = torch.ones(8, device=device)
    dt = concurrent_seconds(lambda: d + 1, device, window_s=0.05)
    pt = concurrent_seconds(lambda: plain + 1, device, window_s=0.05)
    return max(dt - pt, 0.0)


def _layer_step_seconds(plan_text: str, device: Any, *, layers: int, microbatches: int = 1) -> float:
    """Seconds of one forward + backward of a tiny built-in GPT (``layers`` blocks, hidden 8 per
    rank) under ``plan_text`` ("" for the plain model; with pipeline stages, ``microbatches``
    microbatches of 2 samples through the schedule), in concurrent windows (every rank makes the
    same calls: the sharded model communicates)."""
    import contextlib

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

    def loss_fn(out: Any, target: Any) -> Any:
        return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))

    ids = torch.zeros(2 * microbatches, cfg.seq_len, dtype=torch.long, device=device)
    if not plan_text:
        module, context = GPT(cfg, seed=0).to(device), contextlib.nullcontext
    else:
        plan = Plan.parse(plan_text)
        extra = {"loss_fn": loss_fn} if plan.pp > 1 else {}
        pm = parallelize(GPT(cfg, seed=0).to(device), plan, build_mesh(plan, device.type), **extra)
        if pm.pipeline is not None:
            return concurrent_seconds(lambda: pm.pipeline.step(ids, ids), device, window_s=0.2)
        module, context = pm.module, pm.loss_context

    def step() -> None:
        with context():
            loss_fn(module(ids), ids).backward()

    return concurrent_seconds(step, device, window_s=0.2)


def measure_pipeline_overlap(device: Any, slot_s: float) -> float:
    """How much faster a pipeline stage runs while others idle, as the pipelining runtime really
    gets it (0 when not measured: GPUs, one process, an odd world).

    Every rank a stage of a GPT with one real block each (hidden 128, sequence 128, 2 samples per
    microbatch), 1F1B with ``m = p`` microbatches: on dedicated devices ``(2p - 1)`` slots; on an
    oversubscribed host idle stages free their cores, so ``T = max(m t, (2p - 1) t / o)`` plus the
    slot costs, with ``t`` one stage's forward + backward of a microbatch while every rank computes
    (measured concurrently). Solving for ``o`` gives the effective figure, hand-off latencies
    (a woken stage waiting for a core) included; :func:`oversubscription` keeps the smaller of it
    and the solo/all-busy matmul ratio."""
    import torch
    import torch.distributed as dist

    from shardwise.models.gpt import Block, GPTConfig

    n = dist.get_world_size()
    if device.type == "cuda" or n < 2 or n > 8:
        return 0.0
    hidden, seq, batch = 128, 128, 2
    cfg = GPTConfig(vocab_size=8 * n, seq_len=seq, layers=n, hidden=hidden, heads=2)
    block = Block(cfg).to(device)
    x = torch.randn(batch, seq, hidden, device=device, requires_grad=True)

    def stage() -> None:
        y = block(x)
        y.backward(torch.ones_like(y))

    t = concurrent_seconds(stage, device, window_s=0.2)
    piped = _pipeline_step_seconds(cfg, device, stages=n, microbatches=n, batch=batch)
    p = n
    busy = piped - (2 * p - 1) * slot_s  # the compute part of the pipelined step
    if busy <= p * t:
        return float(p)  # the fill and drain cost nothing: as fast as all stages busy
    return max(1.0, (2 * p - 1) * t / busy)


def _pipeline_step_seconds(cfg: Any, device: Any, *, stages: int, microbatches: int, batch: int) -> float:
    import torch
    import torch.nn.functional as F

    from shardwise.models.gpt import GPT
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize
    from shardwise.plan.plan import Plan

    def loss_fn(out: Any, target: Any) -> Any:
        return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))

    plan = Plan(pp=stages, microbatches=microbatches, schedule="1f1b")
    pm = parallelize(GPT(cfg, seed=0).to(device), plan, build_mesh(plan, device.type), loss_fn=loss_fn)
    ids = torch.zeros(batch * microbatches, cfg.seq_len, dtype=torch.long, device=device)
    return concurrent_seconds(lambda: pm.pipeline.step(ids, ids), device, window_s=0.3)


def measure_parallel_layer_overheads(device: Any, *, layers: int = 4) -> dict[str, float]:
    """Fixed seconds that tensor parallelism, FSDP and pipelining add, measured on a GPT too small
    for bandwidth to matter (hidden 8 per rank): per layer forward + backward under TP over all
    ranks, per FSDP unit (the blocks and the root) under ZeRO-3 / ZeRO-2, and per pipeline
    microbatch slot (every rank a stage; the slope from p to 2p microbatches minus a stage's compute of one
    microbatch). This is the dispatch, hook, schedule and latency work that per-operator figures
    undercount (FSDP2's pre/post hooks, DTensor redistribution, the pipelining runtime)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    if n < 2:
        return {"tp_layer_s": 0.0, "zero3_unit_s": 0.0, "zero2_unit_s": 0.0, "pp_microbatch_s": 0.0}
    plain = _layer_step_seconds("", device, layers=layers)
    tp = _layer_step_seconds(f"tp={n}", device, layers=layers)
    zero3 = _layer_step_seconds(f"zero=3,dp=1,shard={n}", device, layers=layers)
    zero2 = _layer_step_seconds(f"zero=2,dp=1,shard={n}", device, layers=layers)
    # Pipeline: all ranks as stages (at most 8; the tiny GPT gets a block per stage), p and 2p
    # microbatches; each extra microbatch adds one slot to the critical path.
    stages = n if n <= 8 else next(p for p in (8, 4, 2) if n % p == 0) if n % 2 == 0 else 0
    pp_microbatch = 0.0
    if stages > 1:
        pipe_layers = max(layers, stages)
        pipe = f"pp={stages},dp={n // stages},schedule=1f1b"
        one = _layer_step_seconds(pipe + f",microbatches={stages}", device, layers=pipe_layers, microbatches=stages)
        two = _layer_step_seconds(pipe + f",microbatches={2 * stages}", device, layers=pipe_layers, microbatches=2 * stages)
        plain_stack = plain if pipe_layers == layers else _layer_step_seconds("", device, layers=pipe_layers)
        pp_microbatch = max((two - one) / stages - plain_stack / stages, 0.0)
    units = layers + 1
    return {"tp_layer_s": max(tp - plain, 0.0) / layers, "zero3_unit_s": max(zero3 - plain, 0.0) / units,
            "zero2_unit_s": max(zero2 - plain, 0.0) / units, "pp_microbatch_s": pp_microbatch}


def measure_solo_matmul(device: Any, n: int) -> float:
    """fp32 FLOP/s of rank 0 alone (the others wait at a barrier): a process's speed when it has
    the machine to itself, as a pipeline stage has during the fill and drain."""
    import torch

    a = torch.randn(n, n, device=device)
    return 2 * n**3 / solo_seconds(lambda: a @ a, device)


# (hidden, tokens per microbatch, sequence length) of the reference transformer layers: small on a
# CPU, GPT-2 to GPT-3-13B widths on a GPU.
STACK = 4  # blocks per measured stack
CPU_BLOCK_SHAPES = ((64, 512, 128), (128, 512, 128), (256, 512, 128), (512, 256, 128))
GPU_BLOCK_SHAPES = ((512, 8192, 1024), (1024, 8192, 1024), (2048, 8192, 1024), (4096, 8192, 1024))


def measure_block_throughput(device: Any, precisions: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Achieved FLOP/s of transformer layers (a stack of the built-in GPT's ``Block``: LayerNorms,
    q/k/v/o projections, ``scaled_dot_product_attention``, GELU MLP), forward + backward including
    the gradient of the input, in concurrent windows, by precision (fp32, or autocast) and by the
    layer's GEMM dimension ``(tokens h h)^(1/3)`` (the key :meth:`ClusterSpec.block_flops` reads),
    and again under full recomputation (shardwise's own activation checkpointing; key
    ``"<precision>+recompute"``). FLOPs are the analytic ``3 x`` forward FLOPs of
    :class:`~shardwise.plan.stats.TransformerSpec` (model FLOPs: the replayed forward is not counted,
    so the recompute table's rate is lower by what recomputation really costs)."""
    import torch

    from shardwise.models.gpt import Block, GPTConfig
    from shardwise.plan.stats import TransformerSpec
    from shardwise.train.precision import autocast

    from shardwise.parallel.checkpointing import apply_checkpointing

    shapes = GPU_BLOCK_SHAPES if device.type == "cuda" else CPU_BLOCK_SHAPES
    out: dict[str, dict[str, float]] = {}
    for precision, recompute in [(p, "none") for p in precisions] + [(p, "full") for p in precisions]:
        table = {}
        for hidden, tokens, seq in shapes:
            heads = max(1, hidden // 64)
            cfg = GPTConfig(vocab_size=8, seq_len=seq, layers=1, hidden=hidden, heads=heads)
            # A stack of STACK blocks, not one: a lone block re-run keeps its weights and
            # activations in cache, which a real stack does not (22% faster on this VM's CPU).
            block = apply_checkpointing(torch.nn.Sequential(*(Block(cfg) for _ in range(STACK))).to(device), mode=recompute)
            x = torch.randn(tokens // seq, seq, hidden, device=device, requires_grad=True)

            def step() -> None:
                with autocast(precision, device.type):
                    y = block(x)
                y.backward(torch.ones_like(y))

            flops = STACK * 3 * TransformerSpec(layers=1, hidden=hidden, heads=heads, vocab=8, seq=seq).stats().flops_per_block * (tokens // seq)
            dim = (tokens * hidden * hidden) ** (1 / 3)
            table[f"{dim:.1f}"] = flops / concurrent_seconds(step, device, window_s=0.2, windows=2)
            del block, x
        out[precision if recompute == "none" else f"{precision}+recompute"] = table
    return out


def measure_optimizer(device: Any) -> dict[str, float]:
    """Seconds of ``torch.optim.Adam.step`` (the device's default implementation) per parameter
    tensor, per tensor when the parameters are DTensors sharded over the world (what FSDP2 and TP
    hand the optimizer), and per element: from 64 small tensors and one large one
    (``t = tensors a + elements b``), in concurrent windows."""
    import torch
    import torch.distributed as dist

    def seconds(params: list) -> float:
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.Adam(params, lr=1e-3)
        return concurrent_seconds(opt.step, device, window_s=0.1)

    small_n, small_size = 64, 256
    big_size = 2**22 if device.type == "cuda" else 2**20
    t_small = seconds([torch.zeros(small_size, device=device, requires_grad=True) for _ in range(small_n)])
    t_big = seconds([torch.zeros(big_size, device=device, requires_grad=True)])
    per_param = max((small_n * t_big - t_small) / (small_n * big_size - small_n * small_size), 0.0)
    per_tensor = max(t_big - big_size * per_param, t_small / small_n - small_size * per_param, 0.0)
    dtensor_tensor = 0.0
    if dist.get_world_size() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        shards = [torch.nn.Parameter(distribute_tensor(torch.zeros(small_size * dist.get_world_size(), device=device), mesh, [Shard(0)]))
                  for _ in range(small_n)]
        dtensor_tensor = max(seconds(shards) / small_n - small_size * per_param, 0.0)
    return {"tensor_s": per_tensor, "dtensor_tensor_s": dtensor_tensor, "param_s": per_param}


def measure_memory_bw(device: Any, *, nbytes: int = 64 * 2**20) -> float:
    """Bytes per second of a large copy (read + write) while every rank copies."""
    import torch

    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / concurrent_seconds(lambda: dst.copy_(src), device, window_s=0.1)


CPU_MATMUL_SIZES = (64, 128, 256, 512, 1024)
GPU_MATMUL_SIZES = (256, 1024, 4096, 8192)


def calibrate_worker(sizes: list[int], matmul_sizes: list[int] | None, iters: int) -> Calibration:
    """Runs on every rank of an initialized group: a group started by :func:`calibrate`, or a
    training job's own world (``Trainer(plan="auto")``). It measures with the intra-op threads the
    process already has (``shardwise run`` gives each local process the cores divided among them),
    because that is what training will get; ``matmul_sizes`` None: the device's default sizes."""
    import torch
    import torch.distributed as dist

    from shardwise.observe.collectives import measure_bandwidth

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if matmul_sizes is None:
        matmul_sizes = list(GPU_MATMUL_SIZES if device.type == "cuda" else CPU_MATMUL_SIZES)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if device.type == "cuda":
        dtypes["fp16"] = torch.float16
    matmul = {name: {n: measure_matmul(device, dt, n) for n in matmul_sizes} for name, dt in dtypes.items()}
    memory_bw = measure_memory_bw(device)
    overhead = measure_overhead(device)
    dtensor = measure_dtensor_overhead(device)
    layer_overheads = measure_parallel_layer_overheads(device)
    block = measure_block_throughput(device, ("fp32", "bf16"))
    optimizer = measure_optimizer(device)
    solo = measure_solo_matmul(device, max(matmul_sizes))
    layer_overheads["pipeline_overlap"] = measure_pipeline_overlap(device, layer_overheads.get("pp_microbatch_s", 0.0))
    rows = measure_bandwidth(device, list(sizes), iters=iters)
    n = dist.get_world_size()
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / n
    return Calibration(n, device.type, matmul, memory_bw, overhead, dtensor, layer_overheads, block, optimizer, solo, rows,
                       memory, threads=torch.get_num_threads())


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


def _calibrate_with_threads(threads: int, sizes: list[int], matmul_sizes: list[int] | None, iters: int) -> Calibration:
    """A CPU worker of :func:`calibrate` with ``shardwise run``'s thread rule (cores / local processes):
    more threads than cores make OpenMP spin and slow small matmuls ~100x."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(threads)
    return calibrate_worker(sizes, matmul_sizes, iters)


def calibrate(nproc: int, *, sizes: tuple[int, ...] = DEFAULT_SIZES, matmul_sizes: tuple[int, ...] | None = None,
              iters: int = 10, name: str | None = None, timeout_s: float = 300.0) -> ClusterSpec:
    """Start ``nproc`` local processes (each with the cores divided among them, as ``shardwise run``
    gives), measure, and return the spec (rank 0's view)."""
    from shardwise.launch.inprocess import launch

    sizes_arg = list(matmul_sizes) if matmul_sizes is not None else None
    threads = max(1, (os.cpu_count() or 1) // nproc)
    cal = launch(_calibrate_with_threads, nprocs=nproc, args=(threads, list(sizes), sizes_arg, iters), timeout_s=timeout_s)[0]
    return to_spec(cal, name=name)
