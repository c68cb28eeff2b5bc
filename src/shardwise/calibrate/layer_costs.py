"""What parallel layers, real transformer layers and the optimizer cost on this machine.

Measured on the built-in GPT by :func:`shardwise.calibrate.calibration.calibrate_worker`, in concurrent
windows (:mod:`shardwise.calibrate.timing`): the fixed costs of tensor parallelism, FSDP units and
pipeline slots on a GPT too small for bandwidth to matter; how much a pipeline stage gains while
the others idle; the throughput of a stack of real transformer layers, plain and under full
recomputation; and Adam's step per tensor, per DTensor and per element.
"""

from __future__ import annotations

import warnings
from typing import Any

from shardwise.calibrate.timing import FULL, Windows, concurrent_seconds


def _tiny_gpt(layers: int) -> Any:
    """A GPT too small for bandwidth to matter: hidden 8 per rank, one head per rank, 8 tokens."""
    import torch.distributed as dist

    from shardwise.models.gpt import GPTConfig

    n = dist.get_world_size()
    return GPTConfig(vocab_size=8 * n, seq_len=8, layers=layers, hidden=8 * n, heads=n)


def _layer_step_seconds(plan_text: str, device: Any, *, cfg: Any, batch: int = 2, timing: Windows = FULL) -> float:
    """Seconds of one forward + backward of the built-in GPT ``cfg`` on ``batch`` samples under
    ``plan_text`` ("" for the plain model; with pipeline stages, the whole schedule over the plan's
    microbatches), in concurrent windows (every rank makes the same calls: the sharded model
    communicates)."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from shardwise.models.gpt import GPT
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize
    from shardwise.layout import Plan

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # GPT returns a view; harmless here

    def loss_fn(out: Any, target: Any) -> Any:
        return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))

    ids = torch.zeros(batch, cfg.seq_len, dtype=torch.long, device=device)
    if not plan_text:
        module, context = GPT(cfg, seed=0).to(device), contextlib.nullcontext
    else:
        plan = Plan.parse(plan_text)
        extra = {"loss_fn": loss_fn} if plan.pp > 1 else {}
        pm = parallelize(GPT(cfg, seed=0).to(device), plan, build_mesh(plan, device.type), **extra)
        if pm.pipeline is not None:
            return concurrent_seconds(lambda: pm.pipeline.step(ids, ids), device, window_s=0.2, timing=timing)
        module, context = pm.module, pm.step_context

    def step() -> None:
        with context():
            loss_fn(module(ids), ids).backward()

    return concurrent_seconds(step, device, window_s=0.2, timing=timing)


def measure_pipeline_overlap(device: Any, slot_s: float, timing: Windows = FULL) -> float:
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

    t = concurrent_seconds(stage, device, window_s=0.2, timing=timing)
    pipe = f"pp={n},schedule=1f1b,microbatches={n}"
    piped = _layer_step_seconds(pipe, device, cfg=cfg, batch=batch * n, timing=timing)
    p = n
    busy = piped - (2 * p - 1) * slot_s  # the compute part of the pipelined step
    if busy <= p * t:
        return float(p)  # the fill and drain cost nothing: as fast as all stages busy
    return max(1.0, (2 * p - 1) * t / busy)


def measure_parallel_layer_overheads(device: Any, *, layers: int = 4, timing: Windows = FULL) -> dict[str, float]:
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
    tiny = _tiny_gpt(layers)
    plain, tp, zero3, zero2 = (
        _layer_step_seconds(plan, device, cfg=tiny, timing=timing)
        for plan in ("", f"tp={n}", f"zero=3,dp=1,shard={n}", f"zero=2,dp=1,shard={n}")
    )
    # Pipeline: all ranks as stages (at most 8; the tiny GPT gets a block per stage), p and 2p
    # microbatches; each extra microbatch adds one slot to the critical path.
    stages = n if n <= 8 else next(p for p in (8, 4, 2) if n % p == 0) if n % 2 == 0 else 0
    pp_microbatch = 0.0
    if stages > 1:
        piped = _tiny_gpt(max(layers, stages))
        pipe = f"pp={stages},dp={n // stages},schedule=1f1b"
        one, two = (
            _layer_step_seconds(pipe + f",microbatches={m * stages}", device, cfg=piped, batch=2 * m * stages,
                                timing=timing)
            for m in (1, 2)
        )
        plain_stack = plain if piped.layers == layers else _layer_step_seconds("", device, cfg=piped, timing=timing)
        pp_microbatch = max((two - one) / stages - plain_stack / stages, 0.0)
    units = layers + 1
    return {"tp_layer_s": max(tp - plain, 0.0) / layers, "zero3_unit_s": max(zero3 - plain, 0.0) / units,
            "zero2_unit_s": max(zero2 - plain, 0.0) / units, "pp_microbatch_s": pp_microbatch}


STACK = 4  # blocks per measured stack
SLOW_CALL_S = 1.0  # a shape whose step would take longer (extrapolated by FLOPs) is scaled from fp32
CPU_BLOCK_SHAPES = ((64, 512, 128), (128, 512, 128), (256, 512, 128), (512, 256, 128))
GPU_BLOCK_SHAPES = ((512, 8192, 1024), (1024, 8192, 1024), (2048, 8192, 1024), (4096, 8192, 1024))


def measure_block_throughput(
    device: Any, precisions: tuple[str, ...], *, widths: int | None = None, timing: Windows = FULL
) -> dict[str, dict[str, float]]:
    """Achieved FLOP/s of transformer layers (a stack of the built-in GPT's ``Block``: LayerNorms,
    q/k/v/o projections, ``scaled_dot_product_attention``, GELU MLP), forward + backward including
    the gradient of the input, in concurrent windows, by precision (fp32, or autocast) and by the
    layer's GEMM dimension ``(tokens h h)^(1/3)`` (the key :meth:`ClusterSpec.block_flops` reads),
    and again under full recomputation (shardwise's own activation checkpointing; key
    ``"<precision>+recompute"``). FLOPs are the analytic ``3 x`` forward FLOPs of
    :class:`~shardwise.plan.stats.TransformerSpec` (model FLOPs: the replayed forward is not counted,
    so the recompute table's rate is lower by what recomputation really costs). A shape whose step
    would exceed ``SLOW_CALL_S`` in a reduced precision (bf16 emulated on a CPU) takes fp32's rate
    there times the reduced/fp32 ratio of the largest shape timed. ``widths``: only that many of
    the narrowest shapes (``shardwise calibrate --quick``; None: all four)."""
    import torch

    from shardwise.models.gpt import Block, GPTConfig
    from shardwise.plan.stats import TransformerSpec, transformer_stats
    from shardwise.parallel.precision import autocast

    from shardwise.parallel.checkpointing import apply_checkpointing

    shapes = (GPU_BLOCK_SHAPES if device.type == "cuda" else CPU_BLOCK_SHAPES)[:widths]
    out: dict[str, dict[str, float]] = {}
    for precision, recompute in [(p, "none") for p in precisions] + [(p, "full") for p in precisions]:
        table: dict[str, float] = {}
        reference = out.get("fp32" if recompute == "none" else "fp32+recompute", {})
        last_call_s, last_flops = 0.0, 0.0
        for hidden, tokens, seq in shapes:
            heads = max(1, hidden // 64)
            flops = (
                STACK
                * 3
                * transformer_stats(
                    TransformerSpec(layers=1, hidden=hidden, heads=heads, vocab_size=8, seq_len=seq)
                ).flops_per_block
                * (tokens // seq)
            )
            dim = f"{(tokens * hidden * hidden) ** (1 / 3):.1f}"
            if table and dim in reference and last_call_s * flops / last_flops > SLOW_CALL_S:
                # A CPU without bf16 units emulates it ~20x slower than fp32: the larger shapes would
                # take minutes. Their rate is fp32's at that shape scaled by the ratio measured at the
                # largest shape timed (every rank decides alike: the times are the slowest rank's).
                last = list(table)[-1]
                table[dim] = reference[dim] * table[last] / reference[last]
                continue
            cfg = GPTConfig(vocab_size=8, seq_len=seq, layers=1, hidden=hidden, heads=heads)
            # A stack of STACK blocks, not one: a lone block re-run keeps its weights and
            # activations in cache, which a real stack does not (22% faster on this VM's CPU).
            block = apply_checkpointing(
                torch.nn.Sequential(*(Block(cfg) for _ in range(STACK))).to(device), mode=recompute
            )
            x = torch.randn(tokens // seq, seq, hidden, device=device, requires_grad=True)

            def step() -> None:
                with autocast(precision, device.type):
                    y = block(x)
                y.backward(torch.ones_like(y))

            last_call_s, last_flops = concurrent_seconds(step, device, window_s=0.2, windows=2, timing=timing), flops
            table[dim] = flops / last_call_s
            block = x = None  # freed before the next size is built
        out[precision if recompute == "none" else f"{precision}+recompute"] = table
    return out


def measure_optimizer(device: Any, timing: Windows = FULL) -> dict[str, float]:
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
        return concurrent_seconds(opt.step, device, window_s=0.1, timing=timing)

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
        shards = [
            torch.nn.Parameter(
                distribute_tensor(torch.zeros(small_size * dist.get_world_size(), device=device), mesh, [Shard(0)])
            )
            for _ in range(small_n)
        ]
        dtensor_tensor = max(seconds(shards) / small_n - small_size * per_param, 0.0)
    return {"tensor_s": per_tensor, "dtensor_tensor_s": dtensor_tensor, "param_s": per_param}
