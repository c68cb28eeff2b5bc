"""Communication of one step: tensor-parallel collectives, pipeline sends and data-parallel traffic,
each with how much of it hides behind compute.

**Overlap.** A collective that runs beside compute (data-parallel gradient buckets during
backward, FSDP's prefetched all-gathers) hides behind the compute window it overlaps, but not for
free: NCCL's kernels take SMs and HBM bandwidth from the matmuls next to them, in proportion to the
rate they move data (a ring over NVLink runs more channels, on more SMs, than one limited by a
node's NICs). With the cluster's ``overlap`` fraction ``o`` (at the fastest link's rate) the
exposed time of ``c`` seconds of traffic behind a ``w``-second window is
``max(0, c - w) + (1 - o) r min(c, w)`` with ``r`` the collective's rate over the intra-node
link's (``o = 1``: perfect hiding, ``o = 0``: CPU collectives on the compute cores, nothing hides).

**Tensor parallel** (Megatron-LM, Shoeybi et al. 2019 sec. 3; Korthikanti et al. 2022 sec. 4.2.2):
two all-reduces per layer forward and two backward of one microbatch's layer activation
(all-gather + reduce-scatter with sequence parallelism: the same volume), two more under full
recomputation, one each way for the vocabulary-parallel embedding and loss; on the critical path
unless the policy runs async TP (then they overlap the matmuls like data-parallel traffic).
Megatron-LM's sequence parallelism (``RunPolicy.sp_saves_shard``) adds two all-gathers per layer in
backward (the column-parallel inputs it did not keep), behind the data-gradient GEMMs. In the
activation dtype: 2 bytes under the 16-bit policy and autocast, 4 in fp32 training. A calibrated
spec adds its measured fixed cost per TP layer instead of latencies and DTensor dispatch.

**Pipeline**: one send forward and one backward per microbatch and hop, ``2 v (m + p - 1)`` on the
critical path, in the activation dtype (16 bits, or fp32 where autocast keeps the residual stream
fp32), ``1/t`` of it per rank under sequence parallelism; inside a node when the stages' ranks
are, else over the NICs. A calibrated spec adds its measured cost per slot of the critical path.

**Data parallel** (Rajbhandari et al. 2020 sec. 5-7): DDP all-reduces the gradients (overlapping the
last microbatch's backward when the runtime reduces buckets during backward); ZeRO-1 as
``ZeroRedundancyOptimizer`` all-reduces them and broadcasts each rank's updated partition (one
broadcast latency per parameter tensor), as Megatron's distributed optimizer (16-bit policy)
reduce-scatters them and all-gathers the 16-bit parameters; ZeRO-2 (FSDP2) gathers parameters once
per microbatch and reduce-scatters gradients; ZeRO-3 gathers every block before its forward and
again before its backward, every microbatch, and reduce-scatters its gradients (every microbatch
when the runtime accumulates sharded gradients, else once); HSDP adds the all-reduce of the shard
across replicas. FSDP communicates per unit (each block, plus the root's parameters); the first
unit's gather of each pass cannot hide. A calibrated spec's measured fixed cost per unit and
microbatch replaces the latencies and hook estimates. DeepSpeed's ZeRO-3 (``zero3_unit="linear"``)
fetches module by module: one collective per weight matrix and norm, each paying the ring's
``n - 1`` step latencies, which at hundreds of ranks and one sample per rank leaves the gathers
exposed (Narayanan et al. 2021, table 2: ZeRO-3 at 44 TFLOP/s on 1,536 A100s).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.layout import Plan
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.memory import StatePolicy
from shardwise.plan.policy import RunPolicy

DTENSOR_OPS_PER_LAYER = 12  # tensor-parallel DTensor dispatches of one layer's forward (6 linears + hooks)
FSDP_OPS_PER_UNIT = 4  # DTensor-level operations of FSDP2's pre/post hooks per unit and collective


def exposed(cluster: ClusterSpec, comm: float, window: float, *, share: float = 1.0) -> float:
    """Seconds of ``comm`` seconds of traffic left on the critical path behind a compute window;
    ``share``: the collective's data rate over the fastest link's (:meth:`ClusterSpec.link_share`)."""
    hidden = min(comm, max(0.0, window))
    return comm - hidden + (1.0 - cluster.overlap) * share * hidden


@dataclass(frozen=True)
class Comm:
    """Seconds of one step's communication: total and exposed, by kind."""

    tp: float = 0.0
    pp: float = 0.0
    dp_total: float = 0.0
    dp_exposed: float = 0.0
    dp_fixed: float = 0.0  # calibrated per-unit CPU cost (part of dp_exposed)


def tp_time(
    cluster: ClusterSpec,
    plan: Plan,
    run: RunPolicy,
    *,
    boundary: float,
    layers: int,
    compute: float,
    logits: float = 0.0,
) -> float:
    """Exposed tensor-parallel communication of one step (see the module doc); ``boundary``: one
    microbatch's layer activation in bytes, ``compute``: the step's compute it could overlap,
    ``logits``: one microbatch's whole logits in bytes, all-gathered on the last stage when the
    loss is not vocabulary-parallel."""
    t, m = plan.tp, plan.microbatches
    if t <= 1:
        return 0.0
    collectives = 4 + (2 if plan.recompute == "full" else 0)  # 2 fwd + 2 bwd (+2 replayed)
    measured = cluster.tp_layer_overhead_s > 0
    # With a calibrated fixed cost per TP layer (dispatch + collective latency, measured on a tiny
    # model) only the bytes are added; otherwise latency per collective and DTENSOR_OPS_PER_LAYER
    # DTensor dispatches (sharding propagation, redistribution) forward, twice that backward.
    per_layer = collectives * cluster.collective_time("all_reduce", boundary, t, latency=not measured)
    edge = 2 * cluster.collective_time(
        "all_reduce", boundary, t, latency=not measured
    )  # vocab-parallel embedding / loss
    if logits and not (run.loss_parallel or run.chunked_loss):  # the LM head's output gathered for the loss
        edge += cluster.collective_time("all_gather", logits, t, latency=not measured)
    replay = 4 / 3 if plan.recompute == "full" else 1.0  # a replayed forward: a third more of fwd + bwd
    if measured:
        dispatch = replay * cluster.tp_layer_overhead_s
    elif cluster.device_type == "cpu":
        dispatch = 3 * DTENSOR_OPS_PER_LAYER * cluster.dtensor_overhead_s
    else:  # on a GPU the host's dispatch runs ahead of the device (asynchronous launches)
        dispatch = 0.0
    wire = m * (layers * per_layer + edge)
    if run.async_tp:
        wire = exposed(cluster, wire, compute)
    regather = 0.0
    if plan.sequence_parallel and run.sp_saves_shard and plan.recompute != "full":
        # Megatron's sequence parallelism kept only the shard of the two column-parallel inputs:
        # backward all-gathers them again, behind the data-gradient GEMMs (about a third of compute)
        again = m * layers * 2 * cluster.collective_time("all_gather", boundary, t, latency=not measured)
        regather = exposed(cluster, again, compute / 3)
    return wire + regather + m * layers * dispatch


def cp_time(
    cluster: ClusterSpec, plan: Plan, run: RunPolicy, *, kv_bytes: float, layers: int, attention: float
) -> float:
    """Exposed context-parallel traffic of one step: every layer all-gathers one microbatch's keys
    and values (``kv_bytes``, the whole sequence) over the ``c`` ranks of a sequence in forward (and
    in the replayed forward under full recomputation) and reduce-scatters their gradients in
    backward, behind the step's attention time."""
    c = run.context_parallel
    if c <= 1:
        return 0.0
    per_layer = (2 + (1 if plan.recompute == "full" else 0)) * cluster.collective_time(
        "all_gather", kv_bytes, c, stride=plan.tp
    )
    return exposed(
        cluster, plan.microbatches * layers * per_layer, attention, share=cluster.link_share(c, stride=plan.tp)
    )


def ep_time(cluster: ClusterSpec, plan: Plan, *, rows_bytes: float, layers: int) -> float:
    """Expert-parallel traffic of one step, on the critical path: per MoE layer and microbatch two
    all-to-alls forward (the routed rows to the experts' owners and back, ``rows_bytes`` = k x
    tokens x h each) and two backward, two more under full recomputation."""
    if plan.ep <= 1 or rows_bytes <= 0:
        return 0.0
    per_layer = (4 + (2 if plan.recompute == "full" else 0)) * cluster.collective_time(
        "all_to_all", rows_bytes, plan.ep, stride=plan.tp
    )
    return plan.microbatches * layers * per_layer


def pp_time(cluster: ClusterSpec, plan: Plan, *, hop_bytes: float) -> float:
    """Pipeline sends on the critical path of one step (see the module doc)."""
    p, m, v = plan.pp, plan.microbatches, plan.virtual_stages
    if p <= 1:
        return 0.0
    intra = plan.dp_size * plan.tp * 2 <= cluster.devices_per_node
    if cluster.pp_microbatch_overhead_s > 0:
        # Calibrated: a fixed cost per slot of the critical path (v m + p - 1 of them: the
        # schedule's runtime work and the send/receive latency), plus the bytes of each hop.
        return (v * m + p - 1) * cluster.pp_microbatch_overhead_s + 2 * v * (m + p - 1) * (
            cluster.p2p_time(hop_bytes, intra=intra) - cluster.p2p_time(0.0, intra=intra)
        )
    return 2 * v * (m + p - 1) * cluster.p2p_time(hop_bytes, intra=intra)


def dp_time(
    cluster: ClusterSpec,
    plan: Plan,
    policy: StatePolicy,
    run: RunPolicy,
    *,
    stage_params: float,
    layers: int,
    t_fwd: float,
    t_bwd: float,
    stage_tensors: int = 0,
    gather_bytes: float | None = None,
    units_per_block: int = 1,
) -> Comm:
    """Data-parallel communication of one step (see the module doc); ``t_fwd``/``t_bwd``: one
    microbatch's compute, the windows the traffic can hide behind; ``gather_bytes``: bytes per
    parameter FSDP gathers (default the policy's compute dtype; FP8 all-gather: less);
    ``units_per_block``: collectives per block and pass (DeepSpeed's ZeRO-3 gathers module by
    module: one per weight matrix and norm; FSDP one per block)."""
    if plan.dp_size == 1:
        return Comm()
    grads = stage_params * policy.reduce_bytes
    params = stage_params * (policy.compute_bytes if gather_bytes is None else gather_bytes)
    stride = plan.tp
    overlap_bwd = t_bwd if run.grad_reduce_overlap else 0.0
    if plan.zero == 0:
        total = cluster.collective_time("all_reduce", grads, plan.dp, stride=stride)
        return Comm(
            dp_total=total,
            dp_exposed=exposed(cluster, total, overlap_bwd, share=cluster.link_share(plan.dp, stride=stride)),
        )
    if plan.zero == 1:
        return _zero1_time(
            cluster,
            plan,
            policy,
            run,
            grads=grads,
            params=params,
            stage_params=stage_params,
            stage_tensors=stage_tensors,
            overlap_bwd=overlap_bwd,
        )
    return _fsdp_time(
        cluster,
        plan,
        policy,
        run,
        grads=grads,
        params=params,
        layers=layers,
        t_fwd=t_fwd,
        t_bwd=t_bwd,
        overlap_bwd=overlap_bwd,
        units_per_block=units_per_block,
    )


def _zero1_time(
    cluster: ClusterSpec,
    plan: Plan,
    policy: StatePolicy,
    run: RunPolicy,
    *,
    grads: float,
    params: float,
    stage_params: float,
    stage_tensors: int,
    overlap_bwd: float,
) -> Comm:
    """ZeRO-1's data-parallel communication: a reduce-scatter and an all-gather (Megatron's
    distributed optimizer), or ZeroRedundancyOptimizer's all-reduce and per-tensor broadcasts."""
    stride = plan.tp
    if not run.autocast:
        # Megatron's distributed optimizer / DeepSpeed's stage 1: reduce-scatter the gradients
        # (overlapping backward when the runtime does), all-gather the updated 16-bit parameters.
        rs = cluster.collective_time("reduce_scatter", grads, plan.dp_size, stride=stride)
        ag = cluster.collective_time("all_gather", params, plan.dp_size, stride=stride)
        share = cluster.link_share(plan.dp_size, stride=stride)
        return Comm(dp_total=rs + ag, dp_exposed=exposed(cluster, rs, overlap_bwd, share=share) + ag)
    # ZeroRedundancyOptimizer over DDP: the gradient all-reduce overlaps backward; each rank
    # then broadcasts its updated fp32 partition (an all-gather's volume) with nothing to hide
    # behind, one broadcast per parameter tensor (torch's default, parameters_as_bucket_view=False),
    # so every tensor of the stage pays a broadcast latency.
    ar = cluster.collective_time("all_reduce", grads, plan.dp_size, stride=stride)
    gather = cluster.collective_time(
        "all_gather", stage_params * policy.param, plan.shard, stride=stride, latency=False
    )
    gather += stage_tensors * cluster.collective_latency("broadcast", plan.shard, stride=stride)
    share = cluster.link_share(plan.dp_size, stride=stride)
    return Comm(dp_total=ar + gather, dp_exposed=exposed(cluster, ar, overlap_bwd, share=share) + gather)


def _fsdp_time(
    cluster: ClusterSpec,
    plan: Plan,
    policy: StatePolicy,
    run: RunPolicy,
    *,
    grads: float,
    params: float,
    layers: int,
    t_fwd: float,
    t_bwd: float,
    overlap_bwd: float,
    units_per_block: int,
) -> Comm:
    """ZeRO-2 and ZeRO-3 (FSDP, HSDP): per-unit gathers and reduce-scatters, the replicas'
    all-reduce of the shard, and the fixed cost per unit and microbatch."""
    stride = plan.tp
    m = plan.microbatches
    shard, rep = plan.shard, plan.dp
    # FSDP communicates per unit (each block, plus the root's remaining parameters): a collective
    # latency and FSDP's hook work per unit, the bytes split over the units. A calibrated spec has
    # measured that fixed cost per unit and microbatch (hooks + latency of the gathers and the
    # reduce-scatter together); then only the bytes are charged per collective and the fixed cost
    # once per unit and microbatch, exposed (it is CPU work on the critical path).
    units = layers * (units_per_block if plan.zero >= 3 else 1) + 1
    unit_fixed = (
        {3: cluster.zero3_unit_overhead_s, 2: cluster.zero2_unit_overhead_s}.get(plan.zero, 0.0) if shard > 1 else 0.0
    )
    measured = unit_fixed > 0
    hooks = (
        units * FSDP_OPS_PER_UNIT * cluster.dtensor_overhead_s
        if shard > 1 and not measured and cluster.device_type == "cpu"
        else 0.0
    )
    rs = (
        units * cluster.collective_time("reduce_scatter", grads / units, shard, stride=stride, latency=not measured)
        + hooks
    )
    ag = (
        units * cluster.collective_time("all_gather", params / units, shard, stride=stride, latency=not measured)
        + hooks
    )
    replicas = cluster.collective_time("all_reduce", grads / shard, rep, stride=stride * shard)
    fixed = m * units * unit_fixed
    reduces = m if run.sharded_grad_accumulation else 1  # reduce-scatters (and replica all-reduces) per step
    bwd_reduce = reduces * (rs + replicas)
    if plan.zero == 2:
        fwd = m * ag if policy.zero2_shards_params else 0.0  # FSDP2 gathers before each forward
        after = 0.0 if policy.zero2_shards_params else ag  # DeepSpeed stage 2: all-gather the updated parameters
        share = cluster.link_share(shard, stride=stride)
        dp_exposed = (
            exposed(cluster, fwd, m * t_fwd, share=share)
            + exposed(cluster, bwd_reduce, reduces * overlap_bwd, share=share)
            + after
        )
        return Comm(dp_total=fwd + bwd_reduce + after + fixed, dp_exposed=dp_exposed + fixed, dp_fixed=fixed)
    # ZeRO-3 gathers each block before its forward and again before its backward, every microbatch.
    fwd = m * ag
    bwd = m * ag + bwd_reduce
    share = cluster.link_share(shard, stride=stride)
    dp_exposed = exposed(cluster, fwd, m * t_fwd, share=share) + exposed(cluster, bwd, m * t_bwd, share=share)
    first = 2 * m * ag / units  # the first unit's gather of each pass cannot hide
    return Comm(dp_total=fwd + bwd + fixed, dp_exposed=max(dp_exposed, first) + fixed, dp_fixed=fixed)


__all__ = [
    "Comm",
    "DTENSOR_OPS_PER_LAYER",
    "FSDP_OPS_PER_UNIT",
    "cp_time",
    "dp_time",
    "ep_time",
    "exposed",
    "pp_time",
    "tp_time",
]
