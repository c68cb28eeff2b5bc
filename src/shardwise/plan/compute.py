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
  the weighted sum at memory bandwidth (8 bytes per score forward and 10 backward in 16 bits;
  13 and 15 with dropout);
- *pointwise work* at memory bandwidth: two norms (read the residual, write the normalized input),
  two residual adds, the activation function (GELU reads and writes ``f``; SwiGLU ``5 f``),
  dropout, rotary embeddings, autocast's casts (of the weights, every microbatch, and of each
  projection's input); backward moves twice the forward's bytes; the loss over the logits
  (24 bytes per logit with a fused kernel, 32 unfused);
- a fixed cost per operator launch (``kernel_overhead_s``, ~20 per layer forward, twice that
  backward): on a GPU the host launches asynchronously, so a layer costs the larger of its device
  time and its launch time; on a CPU they add.

Recomputation replays, per mode (:mod:`shardwise.plan.memory`): ``full`` one forward of every
layer; ``layer`` half of that; ``op`` every other matmul and all pointwise work; ``matmuls`` the
pointwise work; ``attention`` the attention core (eager: its matmuls and ``s^2`` traffic; fused:
nothing, FlashAttention recomputes internally anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.layout import Plan
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.memory import layer_tensors, recompute_mode
from shardwise.plan.policy import RunPolicy
from shardwise.plan.stats import ModelStats

KERNELS_PER_LAYER = 20  # operators of one transformer layer's forward (matmuls, norms, adds, attention)
GEMM_K0 = 128  # a GEMM tile's fixed prologue/epilogue, in inner-dimension elements (about two k-steps of 64)
CAUSAL_BLOCK = 128  # query/key tile of FlashAttention's causal kernel


@dataclass(frozen=True)
class MicrobatchTime:
    """Seconds of one microbatch on the busiest stage; ``parts``: the same split by kind of work."""

    fwd: float
    bwd: float  # including what recomputation replays
    parts: dict[str, float] = field(default_factory=dict)  # gemm, attention, pointwise, head, launch, recompute

    @property
    def total(self) -> float:
        return self.fwd + self.bwd


def microbatch_time(stats: ModelStats, cluster: ClusterSpec, plan: Plan, run: RunPolicy, *, mbs: int, layers: int) -> MicrobatchTime:
    """Forward and backward of one microbatch of ``mbs`` samples over ``layers`` blocks plus the
    LM head (see the module doc)."""
    dim = (mbs * stats.seq * max(stats.hidden, 1) * max(stats.hidden / plan.tp, 1)) ** (1 / 3) if stats.hidden else 1024.0
    block_rate = cluster.block_flops(plan.precision, dim) if stats.hidden else None
    if block_rate:
        return _calibrated(stats, cluster, plan, run, mbs=mbs, layers=layers, dim=dim, rate=block_rate)
    if not stats.ffn:
        return _generic(stats, cluster, plan, run, mbs=mbs, layers=layers, dim=dim)
    return _physical(stats, cluster, plan, run, mbs=mbs, layers=layers)


def _calibrated(stats: ModelStats, cluster: ClusterSpec, plan: Plan, run: RunPolicy, *, mbs: int, layers: int, dim: float,
                rate: float) -> MicrobatchTime:
    """A measured transformer layer's forward + backward throughput covers its kernels, memory
    traffic and autograd work; the LM head runs at the matmul rate and its softmax / loss are
    memory-bound (the logits written and read once each way)."""
    t = plan.tp
    act_scale = 2.0 if plan.precision == "fp32" else 1.0
    flops = cluster.matmul_flops(plan.precision, dim)
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
    replay_rate = cluster.block_flops(plan.precision, dim, recompute=True) if mode == "full" else None
    # At the rate measured under full recomputation when there is one (model FLOPs: the replay
    # shows as a lower rate), else the replayed FLOPs at the plain rate.
    layers_s = 3 * layer_fwd / replay_rate if replay_rate else (3 * layer_fwd + extra) / rate
    fwd = layer_fwd / rate + head_fwd / flops + loss_traffic
    bwd = layers_s - layer_fwd / rate + 2 * head_fwd / flops + loss_traffic
    return MicrobatchTime(fwd, bwd, {"layers": layers_s, "head": 3 * head_fwd / flops + 2 * loss_traffic})


def _generic(stats: ModelStats, cluster: ClusterSpec, plan: Plan, run: RunPolicy, *, mbs: int, layers: int, dim: float) -> MicrobatchTime:
    """A model known only by its FLOPs and saved bytes (measured on the meta device): the FLOPs at
    the achievable matmul rate, the saved activations written in forward and read in backward,
    and a launch cost per operator."""
    from shardwise.plan.memory import layer_bytes

    t = plan.tp
    flops = cluster.matmul_flops(plan.precision, dim)
    fwd_flops = mbs * (layers * stats.flops_per_block + stats.flops_head) / t
    mode = recompute_mode(plan, run)
    extra = {"full": mbs * layers * stats.flops_per_block / t, "layer": mbs * layers * stats.flops_per_block / t / 2}.get(mode, 0.0)
    if mode == "attention":
        extra = mbs * layers * stats.attn_flops_per_block / t
    launches = layers * KERNELS_PER_LAYER * cluster.kernel_overhead_s
    produced = layer_bytes(stats, plan, run, mode="none")[0] * mbs * layers
    traffic = produced / cluster.memory_bw
    replayed = produced if mode in ("full", "layer") else 0.0
    fwd = fwd_flops / flops + traffic + launches
    bwd = (2 * fwd_flops + extra) / flops + traffic + replayed / cluster.memory_bw + 2 * launches + (launches if mode == "full" else 0.0)
    return MicrobatchTime(fwd, bwd, {"gemm": (3 * fwd_flops + extra) / flops, "pointwise": 2 * traffic, "launch": 3 * launches})


def gemm_time(cluster: ClusterSpec, m: float, n: float, k: float, *, peak: float, elem: float) -> float:
    """Roofline time of one ``(m x k) @ (k x n)`` GEMM with ``elem``-byte operands."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    # Each output tile runs k / k_step steps plus a fixed prologue and epilogue, so a short inner
    # dimension reaches less of the peak: efficiency x k / (k + GEMM_K0).
    compute = 2 * m * n * k / (peak * cluster.gemm_efficiency_) * (k + GEMM_K0) / k
    memory = elem * (m * k + k * n + m * n) / (cluster.memory_bw * cluster.memory_efficiency)
    return max(compute, memory)


def _physical(stats: ModelStats, cluster: ClusterSpec, plan: Plan, run: RunPolicy, *, mbs: int, layers: int) -> MicrobatchTime:
    t, s = plan.tp, stats.seq
    tokens = mbs * s
    h, f, kv, v = stats.hidden, stats.ffn, stats.kv_hidden or stats.hidden, stats.vocab
    fp32 = plan.precision == "fp32"
    c = 4.0 if fp32 else 2.0  # bytes of a compute-dtype element
    autocast = run.autocast and not fp32
    r = 4.0 if (autocast or fp32) else 2.0  # bytes of a residual-stream element
    bw = cluster.memory_bw * cluster.memory_efficiency
    fp8 = run.linear_dtype == "fp8" and "fp8" in cluster.peak_flops
    peak_lin = cluster.peak("fp8" if fp8 else plan.precision)
    peak = cluster.peak(plan.precision)

    # -- GEMMs of one layer, forward, in forward order (for the per-op recompute policy) --------
    if stats.qkv_input_copies > 1:
        proj = [(h, h), (h, kv), (h, kv)]
    else:
        proj = [(h, h + 2 * kv)]
    shapes = [(k_, n_ / t) for k_, n_ in proj] + [(h / t, h)]
    rows = [tokens] * len(shapes)
    if stats.experts:  # k routed rows per token through an expert's MLP (split by ep, else by tp), the router
        fe, te = stats.expert_ffn, (1 if plan.ep > 1 else t)
        mlp = [(h, fe / te), (h, fe / te), (fe / te, h)] if stats.gated_mlp else [(h, fe / te), (fe / te, h)]
        shapes += [(h, stats.experts)] + mlp
        rows += [tokens] + [tokens * stats.top_k] * len(mlp)
    else:
        shapes += [(h, f / t), (h, f / t), (f / t, h)] if stats.gated_mlp else [(h, f / t), (f / t, h)]
        rows += [tokens] * (3 if stats.gated_mlp else 2)
    elem = 1.0 if fp8 else c
    gemms = [gemm_time(cluster, m_, n_, k_, peak=peak_lin, elem=elem) for m_, (k_, n_) in zip(rows, shapes)]
    gemm_fwd = sum(gemms)
    if fp8:  # each projection casts its input (forward) and its output's gradient (backward) to fp8:
        # 3 bytes (read 2, write 1) per element of K and N; a third of it here, as gemm_fwd counts 3 x
        gemm_fwd += tokens * sum(k_ + n_ for k_, n_ in shapes) / bw

    # -- attention core --------------------------------------------------------------------------
    heads_local = max(stats.heads // t, 1) if stats.heads else 1
    head_dim = h / max(stats.heads, 1)
    ctx = stats.context or s  # keys per query (context parallelism: the whole sequence)
    if stats.attention == "eager":
        batch = mbs * heads_local
        attn_fwd = batch * (gemm_time(cluster, s, ctx, head_dim, peak=peak, elem=c) + gemm_time(cluster, s, head_dim, ctx, peak=peak, elem=c))
        scores = mbs * heads_local * s * ctx * (c / 2)
        attn_fwd_traffic = scores * (13.0 if stats.dropout else 8.0) / bw
        attn_bwd = 2 * attn_fwd + scores * (15.0 if stats.dropout else 10.0) / bw
        attn_fwd += attn_fwd_traffic
    else:
        causal = min(1.0, (1 + CAUSAL_BLOCK / ctx) / 2)
        flops = 4 * tokens * ctx * h / t * causal
        rate = peak * cluster.attention_efficiency_
        attn_fwd, attn_bwd = flops / rate, 2.5 * flops / rate
        attn_fwd_traffic = 0.0

    # -- pointwise work of one layer, forward (bytes) ---------------------------------------------
    shard_norm = t if plan.sequence_parallel else 1
    norms = 2 * (r + c) * h / shard_norm
    adds = 2 * (2 * r + c) * h / shard_norm
    act = (5 if stats.gated_mlp else 2) * c * (stats.top_k * stats.expert_ffn / (1 if plan.ep > 1 else t) if stats.experts else f / t)
    drop = 2 * (2 * c + 1) * h / shard_norm if stats.dropout else 0.0
    rotary = 2 * c * (h + kv) / t if stats.rotary else 0.0
    casts = 0.0
    if autocast:  # each projection casts its fp32 input (the norm's output) to 16 bits: read 4, write 2
        casts = 6.0 * (h * stats.qkv_input_copies + h) / shard_norm
    pointwise_fwd = tokens * (norms + adds + act + drop + rotary + casts) / bw
    if autocast and plan.zero <= 1:  # autocast casts every weight once per microbatch: read 4, write 2
        pointwise_fwd += 6.0 * stats.params_per_block / t / bw

    launch = KERNELS_PER_LAYER * cluster.kernel_overhead_s
    serial = cluster.device_type == "cpu"  # a CPU runs the dispatch and the kernels on the same cores

    def layer(device: float, launches: float) -> float:
        return device + launches if serial else max(device, launches)

    fwd_layer = layer(gemm_fwd + attn_fwd + pointwise_fwd, launch)
    bwd_layer = layer(2 * gemm_fwd + attn_bwd + 2 * pointwise_fwd, 2 * launch)
    mode = recompute_mode(plan, run)
    if mode == "full":
        replay = fwd_layer
    elif mode == "layer":
        replay = fwd_layer / 2
    elif mode == "op":
        names = [x for x in layer_tensors(stats) if x.matmul]
        even = sum(g for g, x in zip(gemms, names) if x.matmul % 2 == 0)
        replay = even + pointwise_fwd
    elif mode == "matmuls":
        replay = pointwise_fwd
    elif mode == "attention":
        replay = attn_fwd if stats.attention == "eager" else 0.0
    else:
        replay = 0.0

    # -- LM head and loss on the last stage -------------------------------------------------------
    head_fwd = gemm_time(cluster, tokens, v / t, h, peak=peak, elem=c) if v else mbs * stats.flops_head / t / (peak * cluster.gemm_efficiency_)
    loss = tokens * v / t * (24.0 if run.fused_loss else 32.0) / bw if v else 0.0
    fwd = layers * fwd_layer + head_fwd + loss / 2
    bwd = layers * (bwd_layer + replay) + 2 * head_fwd + loss / 2
    parts = {
        "gemm": layers * 3 * gemm_fwd, "attention": layers * (attn_fwd + attn_bwd), "pointwise": layers * 3 * pointwise_fwd,
        "head": 3 * head_fwd + loss, "recompute": layers * replay,
        "launch": max(0.0, layers * (fwd_layer + bwd_layer) - layers * (3 * gemm_fwd + attn_fwd + attn_bwd + 3 * pointwise_fwd)),
    }
    return MicrobatchTime(fwd, bwd, parts)


def optimizer_time(stats: ModelStats, cluster: ClusterSpec, plan: Plan, *, stage_params: float, stage_tensors: int) -> float:
    """Seconds of the optimizer step: a calibrated spec's Adam cost per local tensor (per DTensor
    under FSDP2, TP or a pipeline's data-parallel replicate; ZeRO-1 steps its partition of plain
    tensors) plus per element; a preset's Adam reads parameter, gradient and both moments and writes
    three of them, about 28 bytes per local parameter at the memory bandwidth."""
    optimizer_params = stage_params / (plan.shard if plan.zero >= 1 else 1)
    if cluster.optimizer_param_s > 0:
        dtensor = plan.zero >= 2 or plan.tp > 1 or (plan.pp > 1 and plan.dp_size > 1)
        per_tensor = cluster.optimizer_dtensor_tensor_s if dtensor and cluster.optimizer_dtensor_tensor_s > 0 else cluster.optimizer_tensor_s
        tensors = stage_tensors / (plan.shard if plan.zero == 1 else 1)
        return tensors * per_tensor + optimizer_params * cluster.optimizer_param_s
    return optimizer_params * 28.0 / (cluster.memory_bw * cluster.memory_efficiency)


__all__ = ["KERNELS_PER_LAYER", "MicrobatchTime", "gemm_time", "microbatch_time", "optimizer_time"]
