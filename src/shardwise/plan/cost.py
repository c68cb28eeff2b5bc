"""The cost model: memory per rank and step time of one :class:`~shardwise.plan.Plan`.

**Model states** (Rajbhandari et al. 2020, "ZeRO", sec. 3-5). With ``Ψ`` parameters on a rank,
``P``/``G`` bytes per parameter and gradient and ``K`` bytes of optimizer state (fp32 master weights
included) and ``N`` ranks in the sharding group::

    stage 0:  (P + G + K) Ψ        stage 1:  (P + G) Ψ + K Ψ / N
    stage 2:  P Ψ + (G + K) Ψ / N  stage 3:  (P + G + K) Ψ / N

:meth:`StatePolicy.zero_paper` is the paper's convention (fp16 ``P = G = 2``, ``K = 12``: fp32 master
weights, momentum and variance). :meth:`StatePolicy.torch` is what shardwise trains with: the fp32
parameter *is* the master copy and 16-bit compute copies are transient (autocast, or FSDP2's
``MixedPrecisionPolicy`` gathering bf16), so ``P = G = 4`` and Adam adds ``K = 8``.

**Activations** (Korthikanti et al. 2022, table 2): per layer, ``A/t`` with tensor + sequence
parallelism, ``10 s h + (A - 10 s h)/t`` with tensor parallelism alone, the attention-score part
dropped by selective recomputation, only the layer input kept by full recomputation. ``A`` is
16-bit (:mod:`shardwise.plan.stats`); fp32 training doubles it. Mixed precision as torch runs it
(autocast over fp32 parameters, :meth:`StatePolicy.torch`) keeps more than the 16-bit figure: the
residual stream stays fp32 (the LayerNorm inputs and a pipeline stage's input/output: 2 extra bytes
per element), separate q/k/v projections each save their own 16-bit copy of the normalized input,
and every microbatch's forward saves the 16-bit copy autocast made of each weight (not under
FSDP, whose gathered 16-bit parameters are freed or counted as buffers). Buffers: communication
buffers of the busiest moment plus the gradient of the logits at the start of backward (as large as
the logits and the loss's fp32 copy). Measured on one H200
(``bench/planner_gpu.py``): the built-in GPT keeps 44.9 bytes per token and hidden unit and layer
in bf16 (predicted 43) and 65 in fp32 (predicted 64). In-flight
microbatches on the first stage: GPipe ``m``; 1F1B ``min(m, p)``; interleaved 1F1B
``p + (p - 1)/v`` (Narayanan et al. 2021); without pipelining ``1`` (accumulation is sequential).

**Step time**: ``compute + bubble + exposed communication + optimizer``. Compute is
``3 x`` forward FLOPs (+1 forward under full recomputation, + the attention part under selective)
divided by the achievable FLOP/s. Bubble: ``(p-1)/v`` microbatch times, i.e. the fraction
``(p-1)/(v m + p - 1)`` of the pipelined time. Tensor parallel: two all-reduces per layer forward and
two backward on the layer's activation (all-gather + reduce-scatter with sequence parallelism,
same volume). Pipeline: one send forward and one backward per microbatch and hop (with a calibrated spec, a
measured fixed cost per slot of the critical path replaces the per-send latency). Data parallel:
DDP all-reduces the gradients; ZeRO-1 (ZeroRedundancyOptimizer over DDP) all-reduces them and then
broadcasts each rank's updated partition; ZeRO-2 (FSDP2 keeping gathered parameters until backward)
all-gathers parameters once per microbatch and reduce-scatters gradients; ZeRO-3 all-gathers
parameters for forward and again for backward every microbatch and reduce-scatters gradients; HSDP
adds an all-reduce of the shard over the replicas. Gradient
communication overlaps with backward by the cluster's ``overlap`` fraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from shardwise.errors import ConfigError
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.memory import StatePolicy, autocast_extra, buffer_bytes, layer_activation, model_state_bytes, stage_param_count
from shardwise.layout import Plan
from shardwise.plan.stats import ModelStats

__all__ = ["Estimate", "StatePolicy", "bubble_fraction", "estimate", "micro_batch_size", "model_state_bytes", "stage_param_count"]

KERNELS_PER_LAYER = 20  # operators of one transformer layer's forward (matmuls, norms, adds, attention)
DTENSOR_OPS_PER_LAYER = 12  # tensor-parallel DTensor dispatches of one layer's forward (6 linears + hooks)
FSDP_OPS_PER_UNIT = 4  # DTensor-level operations of FSDP2's pre/post hooks per unit and collective


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipelined step: ``(p-1)/(v m + p - 1)`` (GPipe, 1F1B: v = 1)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


@dataclass(frozen=True)
class Estimate:
    """Predicted memory (bytes, the busiest rank) and time (seconds) of one plan and step."""

    plan: Plan
    global_batch: int
    micro_batch_size: int
    memory: dict[str, float]  # params, grads, optimizer, activations, buffers
    time: dict[str, float]  # compute, communication, bubble
    detail: dict[str, float] = field(default_factory=dict)  # tp, pp, dp communication, optimizer step
    step_time_s: float = 0.0
    memory_limit: float = 0.0
    tokens_per_s: float = 0.0
    tflops_per_device: float = 0.0
    mfu: float = 0.0

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def model_state_bytes(self) -> float:
        return self.memory["params"] + self.memory["grads"] + self.memory["optimizer"]

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.memory_limit

    def to_json(self) -> dict[str, Any]:
        """The shape ``shardwise plan --json`` prints for one plan."""
        p = self.plan
        return {
            "dp": p.dp_size, "dp_replicate": p.dp, "dp_shard": p.shard, "tp": p.tp, "pp": p.pp, "zero_stage": p.zero,
            "micro_batch_size": self.micro_batch_size, "num_microbatches": p.microbatches,
            "schedule": p.schedule if p.pp > 1 else "none", "virtual_stages": p.virtual_stages,
            "sequence_parallel": p.sequence_parallel, "recompute": p.recompute, "precision": p.precision, "plan": str(p),
            "memory_per_device_bytes": int(self.memory_total),
            "memory_breakdown": {k: int(v) for k, v in self.memory.items()},
            "step_time_s": self.step_time_s, "time_breakdown": dict(self.time), "time_detail": dict(self.detail),
            "tokens_per_s": self.tokens_per_s, "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
            "fits": self.fits,
        }


def micro_batch_size(plan: Plan, global_batch: int) -> int:
    per_replica, rem = divmod(global_batch, plan.dp_size)
    if rem or per_replica == 0:
        raise ConfigError(f"global batch {global_batch} does not split over dp={plan.dp_size} data-parallel ranks",
                          hint=f"use a multiple of {plan.dp_size}")
    mbs, rem = divmod(per_replica, plan.microbatches)
    if rem or mbs == 0:
        raise ConfigError(f"per-replica batch {per_replica} does not split into microbatches={plan.microbatches}",
                          hint=f"use a divisor of {per_replica}")
    return mbs


def estimate(stats: ModelStats, cluster: ClusterSpec, plan: Plan, *, global_batch: int, policy: StatePolicy | None = None,
             headroom: float = 0.1) -> Estimate:
    """Memory and time of one training step of ``plan`` (see the module doc for every term)."""
    policy = policy or StatePolicy.torch(plan.precision)
    mbs = micro_batch_size(plan, global_batch)
    t, p, m, v = plan.tp, plan.pp, plan.microbatches, plan.virtual_stages
    if p > stats.blocks:
        raise ConfigError(f"plan pp={p} exceeds the model's {stats.blocks} blocks", hint=f"use pp <= {stats.blocks}")
    act_scale = 2.0 if plan.precision == "fp32" else 1.0  # stats are 16-bit
    autocast = plan.precision != "fp32" and policy.param >= 4  # 16-bit compute over fp32 parameters
    resid_scale = 2.0 if autocast else act_scale  # the residual stream stays fp32 under autocast
    layers = math.ceil(stats.blocks / p)  # the busiest stage
    stage_params = stage_param_count(stats, tp=t, pp=p)

    # -- memory ---------------------------------------------------------------------------
    states = model_state_bytes(stage_params, policy, zero=plan.zero, shard=plan.shard)
    boundary = mbs * stats.boundary_bytes * resid_scale  # one block input of one microbatch
    def kept(p: Plan) -> float:  # bytes one layer keeps per sample without full recomputation
        return layer_activation(stats, p) * act_scale + (autocast_extra(stats, p) if autocast else 0.0)

    if plan.recompute == "full":  # only the layer input (the residual stream) is kept
        per_layer = layer_activation(stats, plan) * resid_scale * mbs
    else:
        per_layer = kept(plan) * mbs
        if autocast and plan.zero <= 1:  # autocast's 16-bit weight copies, saved by each microbatch's forward
            per_layer += stats.params_per_block / t * policy.compute_bytes
    if p == 1:
        in_flight = 1.0
    elif plan.schedule == "gpipe":
        in_flight = float(m)
    elif plan.schedule == "interleaved_1f1b":
        in_flight = min(m, p) + (p - 1) / v
    else:
        in_flight = float(min(m, p))
    logits = mbs * stats.logits_bytes / t * (act_scale + 2.0)  # the logits plus the loss's fp32 softmax
    stage_acts = in_flight * layers * per_layer
    if plan.recompute == "full":  # one layer replayed at a time
        stage_acts += kept(replace(plan, recompute="none")) * mbs
    last_in_flight = in_flight if plan.schedule == "gpipe" or p == 1 else 1.0
    activations = stage_acts + boundary + last_in_flight * logits
    buffers = buffer_bytes(stats, plan, policy, layers=layers, boundary=boundary) + logits  # + the loss's gradient
    memory = {"params": states["params"], "grads": states["grads"], "optimizer": states["optimizer"],
              "activations": activations, "buffers": buffers}

    # -- time -------------------------------------------------------------------------------
    # Matmul efficiency depends on size: the typical GEMM of a layer is (tokens x hidden) @ (hidden x hidden/t).
    tokens_mb = mbs * stats.seq
    dim = (tokens_mb * max(stats.hidden, 1) * max(stats.hidden / t, 1)) ** (1 / 3) if stats.hidden else 1024.0
    flops = cluster.matmul_flops(plan.precision, dim)
    # The last stage is the busiest: its share of the blocks plus the LM head.
    fwd = mbs * (layers * stats.flops_per_block + stats.flops_head) / t
    extra = 0.0
    if plan.recompute == "full":
        extra = mbs * layers * stats.flops_per_block / t
    elif plan.recompute == "selective":
        extra = mbs * layers * stats.attn_flops_per_block / t
    block_rate = cluster.block_flops(plan.precision, dim) if stats.hidden else None
    if block_rate:
        # Calibrated: a real transformer layer's measured forward + backward throughput covers its
        # kernels, memory traffic and autograd work; the LM head runs at the matmul rate and its
        # softmax / loss are memory-bound (the logits written and read once each way).
        layer_fwd = mbs * layers * stats.flops_per_block / t
        head_fwd = mbs * stats.flops_head / t
        loss_traffic = mbs * stats.logits_bytes / t * (act_scale + 2.0) / cluster.memory_bw
        replay_rate = cluster.block_flops(plan.precision, dim, recompute=True) if plan.recompute == "full" else None
        # Layers' forward + backward: at the rate measured under full recomputation when there is
        # one (model FLOPs: the replay shows as a lower rate), else the replayed FLOPs at the plain rate.
        layers_s = 3 * layer_fwd / replay_rate if replay_rate else (3 * layer_fwd + extra) / block_rate
        t_fwd = layer_fwd / block_rate + head_fwd / flops + loss_traffic
        t_bwd = layers_s - layer_fwd / block_rate + 2 * head_fwd / flops + loss_traffic
    else:
        # Eager execution launches ~KERNELS_PER_LAYER operators per layer forward, twice that backward.
        launches = layers * KERNELS_PER_LAYER * cluster.kernel_overhead_s
        # Activation traffic: each activation is written in forward and read in backward, whether it
        # is kept or recomputed (recomputation writes it again: the replayed share of it).
        produced = layer_activation(stats, plan, recompute="none") * mbs * act_scale * layers
        replayed = {"full": produced, "selective": produced * stats.attn_act_bytes_per_block / max(stats.act_bytes_per_block, 1.0)}
        traffic = produced / cluster.memory_bw
        t_fwd = fwd / flops + traffic + launches
        t_bwd = (2 * fwd + extra) / flops + traffic + replayed.get(plan.recompute, 0.0) / cluster.memory_bw + 2 * launches
        if plan.recompute == "full":
            t_bwd += launches
    t_mb = t_fwd + t_bwd
    compute = m * t_mb
    bubble = 0.0
    if p > 1:
        # Critical path: m microbatches plus (p-1)/v fill-and-drain slots. On a host with more
        # processes than cores (oversubscription o > 1) a lone busy stage runs up to o times faster
        # than when all share the cores, and idle stages give their cores away, so the step is
        # max(work-conserving bound m t_mb, critical path at solo speed); on GPUs (o = 1) this is
        # the textbook (m + (p-1)/v) t_mb.
        o = max(1.0, cluster.oversubscription)
        bubble = max(0.0, (m + (p - 1) / v) * t_mb / o - compute)

    tp_comm = 0.0
    if t > 1:
        collectives = 4 + (2 if plan.recompute == "full" else 0)  # 2 fwd + 2 bwd (+2 replayed)
        measured = cluster.tp_layer_overhead_s > 0
        # With a calibrated fixed cost per TP layer (dispatch + collective latency, measured on a
        # tiny model) only the bytes are added; otherwise latency per collective and ~DTENSOR_OPS_PER_LAYER
        # DTensor dispatches (sharding propagation, redistribution) forward, twice that backward.
        per_layer_tp = collectives * cluster.collective_time("all_reduce", boundary, t, latency=not measured)
        edge = 2 * cluster.collective_time("all_reduce", boundary, t, latency=not measured)  # vocab-parallel embedding / loss
        replay = 4 / 3 if plan.recompute == "full" else 1.0  # a replayed forward: a third more of fwd + bwd
        dispatch = replay * cluster.tp_layer_overhead_s if measured else 3 * DTENSOR_OPS_PER_LAYER * cluster.dtensor_overhead_s
        tp_comm = m * (layers * (per_layer_tp + dispatch) + edge)

    pp_comm = 0.0
    if p > 1:
        hop_bytes = boundary / (t if plan.sequence_parallel else 1)
        intra = plan.dp_size * t * 2 <= cluster.devices_per_node
        if cluster.pp_microbatch_overhead_s > 0:
            # Calibrated: a fixed cost per slot of the critical path (v m + p - 1 of them: the
            # schedule's runtime work and the send/receive latency), plus the bytes of each hop.
            pp_comm = ((v * m + p - 1) * cluster.pp_microbatch_overhead_s
                       + 2 * v * (m + p - 1) * (cluster.p2p_time(hop_bytes, intra=intra) - cluster.p2p_time(0.0, intra=intra)))
        else:
            pp_comm = 2 * v * (m + p - 1) * cluster.p2p_time(hop_bytes, intra=intra)

    stage_tensors = layers * stats.tensors_per_block + stats.tensors_outer
    dp_comm, dp_exposed = _dp_comm(cluster, plan, policy, stage_params=stage_params, layers=layers,
                                   params_per_block=stats.params_per_block / t, t_fwd=t_fwd, t_bwd=t_bwd,
                                   stage_tensors=stage_tensors)
    optimizer_params = stage_params / (plan.shard if plan.zero >= 1 else 1)
    if cluster.optimizer_param_s > 0:
        # Calibrated Adam: per tensor (DTensor parameters under FSDP2 / TP / a pipeline's replicate
        # pay DTensor dispatch on every operator) plus per element. ZeRO-1 steps its partition only.
        dtensor = plan.zero >= 2 or t > 1 or (p > 1 and plan.dp_size > 1)
        per_tensor = cluster.optimizer_dtensor_tensor_s if dtensor and cluster.optimizer_dtensor_tensor_s > 0 else cluster.optimizer_tensor_s
        tensors = stage_tensors / (plan.shard if plan.zero == 1 else 1)
        t_opt = tensors * per_tensor + optimizer_params * cluster.optimizer_param_s
    else:
        # Adam reads param, grad, m, v and writes param, m, v: about 7 x 4 bytes per parameter.
        t_opt = optimizer_params * 28.0 / cluster.memory_bw

    communication = tp_comm + pp_comm + dp_exposed
    step = compute + bubble + communication + t_opt
    tokens = global_batch * stats.seq
    model_flops = 3 * stats.flops_per_sample * global_batch
    world = plan.world_size
    achieved = model_flops / step / world
    return Estimate(
        plan=plan, global_batch=global_batch, micro_batch_size=mbs, memory=memory,
        time={"compute": compute + t_opt, "communication": communication, "bubble": bubble},
        detail={"tp_comm": tp_comm, "pp_comm": pp_comm, "dp_comm": dp_comm, "dp_comm_exposed": dp_exposed,
                "optimizer": t_opt, "microbatch": t_mb},
        step_time_s=step, memory_limit=cluster.memory_bytes * (1 - headroom), tokens_per_s=tokens / step,
        tflops_per_device=achieved / 1e12, mfu=achieved / cluster.peak(plan.precision),
    )


def _dp_comm(cluster: ClusterSpec, plan: Plan, policy: StatePolicy, *, stage_params: float, layers: int,
             params_per_block: float, t_fwd: float, t_bwd: float, stage_tensors: int = 0) -> tuple[float, float]:
    """(total, exposed) data-parallel communication seconds of one step."""
    if plan.dp_size == 1:
        return 0.0, 0.0
    grads = stage_params * policy.reduce_bytes
    params = stage_params * policy.compute_bytes
    stride = plan.tp
    m = plan.microbatches
    if plan.zero == 0:
        total = cluster.collective_time("all_reduce", grads, plan.dp, stride=stride)
        return total, max(0.0, total - cluster.overlap * t_bwd)
    shard, rep = plan.shard, plan.dp
    # FSDP2 communicates per unit (each block, plus the root's remaining parameters): a collective
    # latency and FSDP's hook work per unit, the bytes split over the units. A calibrated spec has
    # measured that fixed cost per unit and microbatch (hooks + latency of the gathers and the
    # reduce-scatter together); then only the bytes are charged per collective and the fixed cost
    # once per unit and microbatch, exposed (it is CPU work on the critical path).
    units = layers + 1
    unit_fixed = {3: cluster.zero3_unit_overhead_s, 2: cluster.zero2_unit_overhead_s}.get(plan.zero, 0.0) if shard > 1 else 0.0
    measured = unit_fixed > 0
    hooks = units * FSDP_OPS_PER_UNIT * cluster.dtensor_overhead_s if shard > 1 and not measured else 0.0
    rs = units * cluster.collective_time("reduce_scatter", grads / units, shard, stride=stride, latency=not measured) + hooks
    ag = units * cluster.collective_time("all_gather", params / units, shard, stride=stride, latency=not measured) + hooks
    replicas = units * cluster.collective_time("all_reduce", grads / shard / units, rep, stride=stride * shard)
    fixed = m * units * unit_fixed
    if plan.zero == 1:
        # ZeroRedundancyOptimizer over DDP: the gradient all-reduce overlaps backward; each rank
        # then broadcasts its updated fp32 partition (an all-gather's volume) with nothing to hide
        # behind, one broadcast per parameter tensor (torch's default, parameters_as_bucket_view=False),
        # so every tensor of the stage pays a broadcast latency.
        ar = cluster.collective_time("all_reduce", grads, plan.dp_size, stride=stride)
        gather = cluster.collective_time("all_gather", stage_params * policy.param, plan.shard, stride=stride, latency=False)
        gather += stage_tensors * cluster.collective_latency("broadcast", plan.shard, stride=stride)
        return ar + gather, max(0.0, ar - cluster.overlap * t_bwd) + gather
    if plan.zero == 2:
        # Gather once per microbatch before forward (kept for backward), reduce-scatter once.
        fwd, bwd = m * ag, rs + replicas
        exposed = max(0.0, fwd - cluster.overlap * m * t_fwd) + max(0.0, bwd - cluster.overlap * t_bwd)
        return fwd + bwd + fixed, exposed + fixed
    # ZeRO-3 gathers each block before its forward and again before its backward, every microbatch,
    # and reduce-scatters gradients once (accumulation keeps unsharded grads local until the boundary).
    fwd = m * ag
    bwd = m * ag + rs + replicas
    exposed = max(0.0, fwd - cluster.overlap * m * t_fwd) + max(0.0, bwd - cluster.overlap * m * t_bwd)
    # The first block's gather can never hide behind compute.
    first = 2 * m * ag / max(1, layers)
    return fwd + bwd + fixed, max(exposed, first) + fixed
