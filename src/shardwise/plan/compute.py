"""Compute time of one microbatch on the busiest pipeline stage: forward and backward (with what
recomputation replays), by kind of work.

**Calibrated specs** (``shardwise calibrate``) carry a measured transformer-layer throughput table:
the layers cost ``3 x`` their forward FLOPs (plus the replay) at the measured rate for the layer's
GEMM size, the LM head runs at the measured matmul rate and its loss is memory-bound. The per-op
selective policies (``matmuls``, ``op``) are not measured and are priced like full recomputation.

**Presets** model each kind of work from the device's datasheet and three efficiencies
(:class:`~shardwise.plan.cluster.ClusterSpec`):

- *GEMMs* of each projection with its real shape (with tensor parallelism ``t``: q/k/v ``T x h ->
  (h + 2 kv)/t``, output ``T x h/t -> h``, MLP ``T x h -> f/t`` (twice when gated) and
  ``T x f/t -> h``, the LM head ``T x h -> V/t``): a roofline, ``max(2 M N K / (peak e_gemm),
  bytes / (bw e_mem))`` with ``bytes = 2 (MK + KN + MN)``; backward is two GEMMs of each
  (data and weight gradient); a tile's fixed prologue and epilogue cost ``GEMM_K0 = 128`` inner
  elements, so the compute time is scaled by ``(K + 128) / K`` (short inner dimensions, e.g. the
  small models' ``h`` or a tensor-parallel ``h / t``, reach less of the peak);
- *fused attention* (FlashAttention / SDPA): ``4 T s h / t`` FLOPs forward, of which a causal kernel
  computes the lower triangle plus the diagonal blocks of 128, ``(1 + 128/s) / 2``; backward runs 5
  matmuls where forward ran 2 (``2.5 x``; Dao 2023, FlashAttention-2, sec. 3); at
  ``peak x e_attention`` (a kernel property: FlashAttention-2 reaches ~35% of an H100's peak where it
  reaches 50-73% of an A100's; Shah et al. 2024, FlashAttention-3, sec. 1);
- *eager attention* (Megatron-LM before FlashAttention): ``q k^T`` and ``a v`` as batched GEMMs over
  the full ``s x s`` square, and the ``s^2`` scores written and read by the softmax, dropout and
  the weighted sum at memory bandwidth (with Megatron's fused softmax 8 bytes per score forward
  and 10 backward in 16 bits, 13 and 15 with dropout; as plain torch ops the scaling and the mask
  are two more passes each way, ``EAGER_SCORE_BYTES``);
- *pointwise work* at memory bandwidth: two norms (read the residual, write the normalized input),
  two residual adds, the activation function (GELU reads and writes ``f``; SwiGLU ``5 f``),
  dropout, rotary embeddings, autocast's casts (of the weights, every microbatch, and of each
  projection's input); backward moves the forward's bytes again plus what the norms' and the
  activation function's gradients read beside the incoming gradient; the loss over the logits
  (24 bytes per logit with a fused kernel, 32 unfused);
- a fixed cost per operator launch (``kernel_overhead_s``, ~20 per layer forward, twice that
  backward): on a GPU the host launches asynchronously, so a layer costs the larger of its device
  time and its launch time; on a CPU they add.

Recomputation replays, per mode (:mod:`shardwise.plan.activations`): ``full`` one forward of every
layer; ``layer`` half of that; ``op`` every other matmul and all pointwise work; ``matmuls`` the
pointwise work (with eager attention: its softmax and dropout over the scores); ``attention`` the
attention core (eager: its matmuls and ``s^2`` traffic; fused: nothing, FlashAttention recomputes
internally anyway).

**FP8 linears** (``Plan.precision="fp8"``, torchao float8 training): each block projection whose
per-rank ``K`` and ``N`` are multiples of 16 runs its three GEMMs (forward, data and weight
gradient) at the FP8 peak times ``ClusterSpec.fp8_gemm_efficiency_`` with 1-byte operands, plus
the memory traffic of the casts as torchao's own roofline counts it
(``torchao/testing/training/roofline_utils.py``, no fusion with the previous op): tensorwise
scaling reads an input or output gradient twice (the amax pass, then the cast writing the row- and
column-major copies: 2 + 2 + 2 bytes per element) and a weight four times (2 + (2 + 1) + (2 + 1));
rowwise scaling 8 bytes per element of an input or output gradient and 10 of a weight (a transpose
between the two casts). Compiled (``Plan.compile``), the amax pass fuses into the op before it
(2 bytes less per element) and separate q/k/v projections share one cast of their input; under
FSDP's FP8 all-gather each rank casts only its weight shard, once per step. The LM head and the
attention core stay bf16 (torchao's and torchtitan's filter), as does any layer whose shape the FP8
kernels cannot take.

**Chunked loss** (``Plan.chunked_loss``, :mod:`shardwise.parallel.linear_ce`): the same three head
GEMMs and the loss traffic of a fused loss, no recomputation, plus a launch cost per chunk
(``C = N d / (V/t)`` tokens a chunk; ~8 operators each way).

"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from shardwise.layout import Plan
from shardwise.plan.activations import layer_bytes, layer_tensors, recompute_mode
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.layer_kernels import (
    FP8_CAST_BYTES,
    attention_core,
    fp8_gemm_time,
    gemm_time,
    layer_gemms,
    pointwise_work,
)
from shardwise.plan.policy import RunPolicy, compute_precision
from shardwise.plan.stats import ModelStats

KERNELS_PER_LAYER = 20  # operators of one transformer layer's forward (matmuls, norms, adds, attention)
CHUNK_KERNELS = (
    8  # operators of one chunk of the chunked loss, each way (head matmul, upcast, log-softmax, loss, gradient)
)


@dataclass(frozen=True)
class MicrobatchTime:
    """Seconds of one microbatch on the busiest stage; ``parts``: the same split by kind of work."""

    fwd: float
    bwd: float  # including what recomputation replays
    parts: dict[str, float] = field(default_factory=dict)  # gemm, attention, pointwise, head, launch, recompute

    @property
    def total(self) -> float:
        return self.fwd + self.bwd


def microbatch_time(
    stats: ModelStats, cluster: ClusterSpec, plan: Plan, run: RunPolicy, *, mbs: int, layers: int
) -> MicrobatchTime:
    """Forward and backward of one microbatch of ``mbs`` samples over ``layers`` blocks plus the
    LM head (see the module doc)."""
    dim = (
        (mbs * stats.seq * max(stats.hidden, 1) * max(stats.hidden / plan.tp, 1)) ** (1 / 3) if stats.hidden else 1024.0
    )
    block_rate = cluster.block_flops(compute_precision(plan.precision), dim) if stats.hidden else None
    if block_rate:
        return _calibrated(stats, cluster, plan, run, mbs=mbs, layers=layers, dim=dim, rate=block_rate)
    if not stats.ffn:
        return _generic(stats, cluster, plan, run, mbs=mbs, layers=layers, dim=dim)
    return _physical(stats, cluster, plan, run, mbs=mbs, layers=layers)


def _calibrated(
    stats: ModelStats,
    cluster: ClusterSpec,
    plan: Plan,
    run: RunPolicy,
    *,
    mbs: int,
    layers: int,
    dim: float,
    rate: float,
) -> MicrobatchTime:
    """A measured transformer layer's forward + backward throughput covers its kernels, memory
    traffic and autograd work; the LM head runs at the matmul rate and its softmax / loss are
    memory-bound (the logits written and read once each way)."""
    t = plan.tp
    act_scale = 2.0 if plan.precision == "fp32" else 1.0
    flops = cluster.matmul_flops(compute_precision(plan.precision), dim)
    layer_fwd = mbs * layers * stats.flops_per_block / t
    head_fwd = mbs * stats.flops_head / t
    loss_traffic = mbs * stats.logits_bytes / t * (act_scale + 2.0) / cluster.memory_bw
    mode = recompute_mode(plan, run)
    extra = {"full": layer_fwd, "layer": layer_fwd / 2}.get(mode, 0.0)
    if mode == "attention":
        extra = mbs * layers * stats.attn_flops_per_block / t
    # No calibration measures the per-op policies (their dispatch hooks cost more than the
    # pointwise work they replay on a CPU): priced like full recomputation, never as free.
    if mode in ("matmuls", "op"):
        mode, extra = "full", layer_fwd
    replay_rate = (
        cluster.block_flops(compute_precision(plan.precision), dim, recompute=True) if mode == "full" else None
    )
    # At the rate measured under full recomputation when there is one (model FLOPs: the replay
    # shows as a lower rate), else the replayed FLOPs at the plain rate.
    layers_s = 3 * layer_fwd / replay_rate if replay_rate else (3 * layer_fwd + extra) / rate
    fwd = layer_fwd / rate + head_fwd / flops + loss_traffic
    bwd = layers_s - layer_fwd / rate + 2 * head_fwd / flops + loss_traffic
    return MicrobatchTime(fwd, bwd, {"layers": layers_s, "head": 3 * head_fwd / flops + 2 * loss_traffic})


def _generic(
    stats: ModelStats, cluster: ClusterSpec, plan: Plan, run: RunPolicy, *, mbs: int, layers: int, dim: float
) -> MicrobatchTime:
    """A model known only by its FLOPs and saved bytes (measured on the meta device): the FLOPs at
    the achievable matmul rate, the saved activations written in forward and read in backward,
    and a launch cost per operator."""
    t = plan.tp
    flops = cluster.matmul_flops(compute_precision(plan.precision), dim)
    fwd_flops = mbs * (layers * stats.flops_per_block + stats.flops_head) / t
    mode = recompute_mode(plan, run)
    extra = {
        "full": mbs * layers * stats.flops_per_block / t,
        "layer": mbs * layers * stats.flops_per_block / t / 2,
    }.get(mode, 0.0)
    if mode == "attention":
        extra = mbs * layers * stats.attn_flops_per_block / t
    launches = layers * KERNELS_PER_LAYER * cluster.kernel_overhead_s
    produced = layer_bytes(stats, plan, run, mode="none")[0] * mbs * layers
    traffic = produced / cluster.memory_bw
    replayed = produced if mode in ("full", "layer") else 0.0
    fwd = fwd_flops / flops + traffic + launches
    bwd = (
        (2 * fwd_flops + extra) / flops
        + traffic
        + replayed / cluster.memory_bw
        + 2 * launches
        + (launches if mode == "full" else 0.0)
    )
    return MicrobatchTime(
        fwd, bwd, {"gemm": (3 * fwd_flops + extra) / flops, "pointwise": 2 * traffic, "launch": 3 * launches}
    )


def _physical(
    stats: ModelStats, cluster: ClusterSpec, plan: Plan, run: RunPolicy, *, mbs: int, layers: int
) -> MicrobatchTime:
    """One microbatch's forward and backward on one device (module doc): ``layers`` blocks (GEMMs,
    the attention core, the pointwise work, launches and recomputation), then the LM head and the
    loss; ``parts`` says where the time goes."""
    tokens = mbs * stats.seq
    fp32 = plan.precision == "fp32"
    c = 4.0 if fp32 else 2.0  # bytes of a compute-dtype element
    autocast = run.autocast and not fp32
    r = 4.0 if (autocast or fp32) else 2.0  # bytes of a residual-stream element
    bw = cluster.memory_bw * cluster.memory_efficiency
    fp8 = run.fp8 and "fp8" in cluster.peak_flops
    peak = cluster.peak(compute_precision(plan.precision))
    gemms, gemm_bwd, casts_fwd, casts_bwd = layer_gemms(
        stats, cluster, plan, run, tokens=tokens, peak=peak, c=c, bw=bw, fp8=fp8
    )
    gemm_fwd = sum(gemms)
    attn_fwd, attn_bwd, attn_fwd_traffic = attention_core(
        stats, cluster, plan, run, mbs=mbs, tokens=tokens, peak=peak, c=c, bw=bw
    )
    pointwise_fwd, pointwise_bwd = pointwise_work(stats, plan, tokens=tokens, c=c, r=r, bw=bw, autocast=autocast)

    launch = KERNELS_PER_LAYER * cluster.kernel_overhead_s
    serial = cluster.device_type == "cpu"  # a CPU runs the dispatch and the kernels on the same cores

    def layer(device: float, launches: float) -> float:
        return device + launches if serial else max(device, launches)

    fwd_layer = layer(gemm_fwd + casts_fwd + attn_fwd + pointwise_fwd, launch)
    bwd_layer = layer(gemm_bwd + casts_bwd + attn_bwd + pointwise_bwd, 2 * launch)
    replay = _replay(
        stats,
        plan,
        run,
        fwd_layer=fwd_layer,
        gemms=gemms,
        pointwise_fwd=pointwise_fwd,
        attn_fwd=attn_fwd,
        attn_fwd_traffic=attn_fwd_traffic,
    )
    head_fwd, loss = _head(stats, cluster, plan, run, mbs=mbs, tokens=tokens, peak=peak, c=c, bw=bw, layer=layer)
    fwd = layers * fwd_layer + head_fwd + loss / 2
    bwd = layers * (bwd_layer + replay) + 2 * head_fwd + loss / 2
    parts = {
        "gemm": layers * (gemm_fwd + gemm_bwd),
        "attention": layers * (attn_fwd + attn_bwd),
        "pointwise": layers * (pointwise_fwd + pointwise_bwd),
        "head": 3 * head_fwd + loss,
        "recompute": layers * replay,
        "launch": max(
            0.0,
            layers * (fwd_layer + bwd_layer)
            - layers
            * (gemm_fwd + gemm_bwd + casts_fwd + casts_bwd + attn_fwd + attn_bwd + pointwise_fwd + pointwise_bwd),
        ),
    }
    if fp8:
        parts["fp8_casts"] = layers * (casts_fwd + casts_bwd)
    return MicrobatchTime(fwd, bwd, parts)


def _replay(
    stats: ModelStats,
    plan: Plan,
    run: RunPolicy,
    *,
    fwd_layer: float,
    gemms: list[float],
    pointwise_fwd: float,
    attn_fwd: float,
    attn_fwd_traffic: float,
) -> float:
    """What recomputation replays of one layer's forward in backward, by the plan's recompute mode."""
    mode = recompute_mode(plan, run)
    if mode == "full":
        replay = fwd_layer
    elif mode == "layer":
        replay = fwd_layer / 2
    elif mode == "op":
        names = [x for x in layer_tensors(stats) if x.matmul]
        even = sum(g for g, x in zip(gemms, names) if x.matmul % 2 == 0)
        replay = even + pointwise_fwd
    elif mode == "matmuls":  # the pointwise work, and eager attention's softmax and dropout over the scores
        replay = pointwise_fwd + attn_fwd_traffic
    elif mode == "attention":
        replay = attn_fwd if stats.attention == "eager" else 0.0
    else:
        replay = 0.0
    return replay


def _head(
    stats: ModelStats,
    cluster: ClusterSpec,
    plan: Plan,
    run: RunPolicy,
    *,
    mbs: int,
    tokens: int,
    peak: float,
    c: float,
    bw: float,
    layer: Callable[[float, float], float],
) -> tuple[float, float]:
    """The LM head's forward GEMM and the loss on the last stage (seconds)."""
    t, h, v = plan.tp, stats.hidden, stats.vocab
    # -- LM head and loss on the last stage -------------------------------------------------------
    head_fwd = (
        gemm_time(cluster, tokens, v / t, h, peak=peak, elem=c)
        if v
        else mbs * stats.flops_head / t / (peak * cluster.gemm_efficiency_)
    )
    # the loss over this rank's logits: a vocabulary-parallel (or chunked) loss V/t of them, else all V
    vocab_rank = v / t if (run.loss_parallel or run.chunked_loss) else v
    loss = tokens * vocab_rank * (24.0 if run.fused_loss or run.chunked_loss else 32.0) / bw if v else 0.0
    if run.chunked_loss and v:  # each chunk's forward and backward launches
        chunks = math.ceil(v / t / max(h, 1))  # C = N h / (V/t) tokens a chunk
        loss = layer(loss, chunks * 2 * CHUNK_KERNELS * cluster.kernel_overhead_s)
    return head_fwd, loss


def accumulate_time(cluster: ClusterSpec, *, grad_elems: float, grad_bytes: float) -> float:
    """Seconds to add one microbatch's weight gradients into the accumulated ones: read both and
    write the sum, ``3 x grad_bytes`` per local gradient element at the memory bandwidth (under
    sharded accumulation only the reduce-scattered shard is accumulated)."""
    return 3 * grad_bytes * grad_elems / (cluster.memory_bw * cluster.memory_efficiency)


def optimizer_time(
    stats: ModelStats, cluster: ClusterSpec, plan: Plan, *, stage_params: float, stage_tensors: int
) -> float:
    """Seconds of the optimizer step: a calibrated spec's Adam cost per local tensor (per DTensor
    under FSDP2, TP or a pipeline's data-parallel replicate; ZeRO-1 steps its partition of plain
    tensors) plus per element; a preset's Adam reads parameter, gradient and both moments and writes
    three of them, about 28 bytes per local parameter at the memory bandwidth."""
    optimizer_params = stage_params / (plan.shard if plan.zero >= 1 else 1)
    if cluster.optimizer_param_s > 0:
        dtensor = plan.zero >= 2 or plan.tp > 1 or (plan.pp > 1 and plan.dp_size > 1)
        per_tensor = (
            cluster.optimizer_dtensor_tensor_s
            if dtensor and cluster.optimizer_dtensor_tensor_s > 0
            else cluster.optimizer_tensor_s
        )
        tensors = stage_tensors / (plan.shard if plan.zero == 1 else 1)
        return tensors * per_tensor + optimizer_params * cluster.optimizer_param_s
    return optimizer_params * 28.0 / (cluster.memory_bw * cluster.memory_efficiency)


__all__ = [
    "FP8_CAST_BYTES",
    "accumulate_time",
    "KERNELS_PER_LAYER",
    "MicrobatchTime",
    "fp8_gemm_time",
    "gemm_time",
    "microbatch_time",
    "optimizer_time",
]
