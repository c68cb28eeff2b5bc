"""The cost model: memory per rank and step time of one :class:`~shardwise.plan.Plan`.

**Model states** (Rajbhandari et al. 2020, "ZeRO", sec. 3-5). With ``Ψ`` parameters on a rank,
``P``/``G`` bytes per parameter and gradient and ``K`` bytes of optimizer state (fp32 master weights
included) and ``N`` ranks in the sharding group::

    stage 0:  (P + G + K) Ψ        stage 1:  (P + G) Ψ + K Ψ / N
    stage 2:  P Ψ + (G + K) Ψ / N  stage 3:  (P + G + K) Ψ / N

:meth:`StatePolicy.zero_paper` is the paper's convention (fp16 ``P = G = 2``, ``K = 12``: fp32 master
weights, momentum and variance), :meth:`StatePolicy.megatron` Megatron-LM's (16-bit parameters,
fp32 gradients, ``K = 12``), :meth:`StatePolicy.torch` shardwise's and FSDP's (the fp32 parameter
*is* the master copy, 16-bit compute copies are transient: ``P = G = 4``, Adam ``K = 8``).

**Activations** per stage (:mod:`shardwise.plan.activations`): what one layer keeps under the
recompute mode and precision policy (:mod:`shardwise.plan.policy`), times the stage's layers and
the microbatches in flight — on the first stage GPipe ``m``, 1F1B ``min(m, p)``, interleaved 1F1B
``min(m, p) + (p - 1)/v`` (Narayanan et al. 2021), without pipelining 1 (accumulation is
sequential); on the last stage one (GPipe ``m``) plus the logits — plus one replayed layer under
recomputation, the stage's input and communication buffers. The busiest stage is reported.

**Step time** = ``compute + bubble + exposed communication + optimizer``: compute is ``m``
microbatches of :func:`shardwise.plan.compute.microbatch_time` and the gradient accumulation of the
``m - 1`` after the first (:func:`~shardwise.plan.compute.accumulate_time`); the bubble is ``(p-1)/v``
microbatch times, i.e. the fraction ``(p-1)/(v m + p - 1)`` of the pipelined step (on an
oversubscribed host ``max(m t, (m + (p-1)/v) t / o)``); communication is
:mod:`shardwise.plan.comm`'s tensor-parallel, pipeline and data-parallel terms.
"""

from __future__ import annotations

import math

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.comm import Comm, cp_time, dp_time, ep_time, pp_time, tp_time
from shardwise.plan.compute import MicrobatchTime, accumulate_time, microbatch_time, optimizer_time
from shardwise.plan.estimate import Estimate
from shardwise.plan.memory import (
    StatePolicy,
    buffer_bytes,
    chunked_loss_bytes,
    expert_param_count,
    gathered_bytes,
    layer_bytes,
    logits_bytes,
    model_state_bytes,
    modules_per_block,
    stage_param_count,
    weight_copy_bytes,
)
from shardwise.plan.adapters import lora_microbatch, lora_state_bytes
from shardwise.plan.policy import RunPolicy, compute_precision
from shardwise.plan.stats import ModelStats, slice_stats

__all__ = [
    "Estimate",
    "RunPolicy",
    "StatePolicy",
    "bubble_fraction",
    "estimate",
    "micro_batch_size",
    "model_state_bytes",
    "stage_param_count",
]


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipelined step: ``(p-1)/(v m + p - 1)`` (GPipe, 1F1B: v = 1)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


def micro_batch_size(plan: Plan, global_batch: int) -> int:
    per_replica, rem = divmod(global_batch, plan.dp_size)
    if rem or per_replica == 0:
        raise ConfigError(
            f"global batch {global_batch} does not split over dp={plan.dp_size} data-parallel ranks",
            hint=f"use a multiple of {plan.dp_size}",
        )
    mbs, rem = divmod(per_replica, plan.microbatches)
    if rem or mbs == 0:
        raise ConfigError(
            f"per-replica batch {per_replica} does not split into microbatches={plan.microbatches}",
            hint=f"use a divisor of {per_replica}",
        )
    return mbs


def _in_flight(plan: Plan) -> tuple[float, float]:
    """Microbatches whose activations the first and the last stage hold at once."""
    p, m, v = plan.pp, plan.microbatches, plan.virtual_stages
    if p == 1:
        return 1.0, 1.0
    if plan.schedule == "gpipe":
        return float(m), float(m)
    if plan.schedule == "interleaved_1f1b":
        return min(m, p) + (p - 1) / v, 1.0
    return float(min(m, p)), 1.0


def estimate(
    stats: ModelStats,
    cluster: ClusterSpec,
    plan: Plan,
    *,
    global_batch: int,
    policy: StatePolicy | None = None,
    headroom: float = 0.1,
    run: RunPolicy | None = None,
) -> Estimate:
    """Memory and time of one training step of ``plan`` (see the module doc for every term)."""
    if plan.cp > 1:
        return _context_parallel(
            stats, cluster, plan, global_batch=global_batch, policy=policy, headroom=headroom, run=run
        )
    run = (run or RunPolicy()).applied(plan)  # the plan's runtime options (params16, chunked_loss, ...) on
    policy = policy or StatePolicy.torch(plan.precision)
    mbs = micro_batch_size(plan, global_batch)
    t, p, m = plan.tp, plan.pp, plan.microbatches
    if p > stats.blocks:
        raise ConfigError(f"plan pp={p} exceeds the model's {stats.blocks} blocks", hint=f"use pp <= {stats.blocks}")
    resid_scale = 2.0 if (plan.precision == "fp32" or run.autocast) else 1.0  # autocast keeps the residual in fp32
    # The busiest stage: its v chunks of at most ceil(L / (p v)) blocks each (the runtime cuts the blocks
    # into p v balanced chunks, uneven when p v does not divide L).
    v = plan.virtual_stages if plan.schedule == "interleaved_1f1b" else 1
    if p * v > stats.blocks:
        raise ConfigError(f"plan pp={p} x virtual_stages={v} exceeds the model's {stats.blocks} blocks",
                          hint=f"use pp x virtual_stages <= {stats.blocks}")
    layers = max(math.ceil(stats.blocks / p), v * math.ceil(stats.blocks / (p * v)))
    stage_params = stage_param_count(stats, tp=t, pp=p, ep=plan.ep)

    boundary = mbs * stats.boundary_bytes * resid_scale  # one block input of one microbatch
    memory = _memory(stats, plan, run, policy, mbs=mbs, layers=layers, stage_params=stage_params, boundary=boundary)

    # -- time -------------------------------------------------------------------------------
    mb = microbatch_time(stats, cluster, plan, run, mbs=mbs, layers=layers)
    if stats.lora is not None:  # no weight gradients for the base, the adapters' GEMMs, NF4 dequantization
        mb = lora_microbatch(stats, mb, cluster, stage_params=stage_params, compute_bytes=policy.compute_bytes)
    accumulate, slot, compute, bubble = _compute_time(cluster, plan, run, policy, mb=mb, stage_params=stage_params)
    stage_tensors = layers * stats.tensors_per_block + stats.tensors_outer
    comm, dp = _communication(
        stats,
        cluster,
        plan,
        run,
        policy,
        mbs=mbs,
        layers=layers,
        compute=compute,
        boundary=boundary,
        mb=mb,
        stage_params=stage_params,
        stage_tensors=stage_tensors,
    )
    t_opt = optimizer_time(stats, cluster, plan, stage_params=stage_params, stage_tensors=stage_tensors)

    communication = comm["tp_comm"] + comm["pp_comm"] + comm["cp_comm"] + comm["ep_comm"] + dp.dp_exposed
    step = compute + bubble + communication + t_opt
    tokens = global_batch * stats.seq
    model_flops = 3 * stats.flops_per_sample * global_batch
    achieved = model_flops / step / plan.world_size
    detail = {**comm, "dp_comm": dp.dp_total, "dp_comm_exposed": dp.dp_exposed, "optimizer": t_opt, "microbatch": slot}
    detail.update({f"compute_{k}": m * v_ for k, v_ in mb.parts.items()})
    if accumulate:
        detail["compute_accumulate"] = accumulate
    return Estimate(
        plan=plan,
        global_batch=global_batch,
        micro_batch_size=mbs,
        memory=memory,
        time={"compute": compute + t_opt, "communication": communication, "bubble": bubble},
        detail=detail,
        step_time_s=step,
        memory_limit=cluster.memory_bytes * (1 - headroom),
        tokens_per_s=tokens / step,
        tflops_per_device=achieved / 1e12,
        mfu=achieved / cluster.peak(compute_precision(plan.precision)),
        run=run,
    )


def _compute_time(
    cluster: ClusterSpec, plan: Plan, run: RunPolicy, policy: StatePolicy, *, mb: MicrobatchTime, stage_params: float
) -> tuple[float, float, float, float]:
    """(accumulate, slot, compute, bubble) seconds of the busiest stage: the gradient accumulation
    of the microbatches after the first, one microbatch's slot with its share of it, the ``m``
    slots, and the pipeline bubble."""
    p, m, v = plan.pp, plan.microbatches, plan.virtual_stages
    # Every microbatch after the first adds its weight gradients into the accumulated ones
    # (autograd's AccumulateGrad, FSDP2's unsharded accumulation): read both, write one.
    grad_elems = stage_params / (plan.shard if run.sharded_grad_accumulation and plan.zero >= 2 else 1)
    accumulate = (
        0.0
        if run.fused_grad_accumulation
        else (m - 1) * accumulate_time(cluster, grad_elems=grad_elems, grad_bytes=policy.grad)
    )
    slot = mb.total + accumulate / m  # one microbatch on a stage, its share of the accumulation included
    compute = m * slot
    bubble = 0.0
    if p > 1:
        # Critical path: m microbatches plus (p-1)/v fill-and-drain slots. On a host with more
        # processes than cores (oversubscription o > 1) a lone busy stage runs up to o times faster
        # than when all share the cores, and idle stages give their cores away, so the step is
        # max(work-conserving bound m t_mb, critical path at solo speed); on GPUs (o = 1) this is
        # the textbook (m + (p-1)/v) t_mb.
        o = max(1.0, cluster.oversubscription)
        bubble = max(0.0, (m + (p - 1) / v) * slot / o - compute)
    return accumulate, slot, compute, bubble


def _communication(
    stats: ModelStats,
    cluster: ClusterSpec,
    plan: Plan,
    run: RunPolicy,
    policy: StatePolicy,
    *,
    mbs: int,
    layers: int,
    compute: float,
    boundary: float,
    mb: MicrobatchTime,
    stage_params: float,
    stage_tensors: int,
) -> tuple[dict[str, float], Comm]:
    """The exposed tensor-, pipeline-, context- and expert-parallel communication of one step (by
    ``time_detail`` key, in that order) and the data-parallel :class:`~shardwise.plan.comm.Comm`."""
    t, m = plan.tp, plan.microbatches
    fp32 = plan.precision == "fp32"
    act_scale = 2.0 if fp32 else 1.0  # stats are 16-bit
    tp_comm = tp_time(
        cluster,
        plan,
        run,
        boundary=mbs * stats.boundary_bytes * act_scale,
        layers=layers,
        compute=compute,
        logits=mbs * stats.logits_bytes * act_scale,
    )
    pp_comm = pp_time(cluster, plan, hop_bytes=boundary / (t if plan.sequence_parallel or run.pp_scatter_gather else 1))
    kv_bytes = mbs * (stats.context or stats.seq) * 2 * (stats.kv_hidden or stats.hidden) / t * (4.0 if fp32 else 2.0)
    cp_comm = cp_time(
        cluster, plan, run, kv_bytes=kv_bytes, layers=layers, attention=m * mb.parts.get("attention", 0.0)
    )
    ep_comm = ep_time(
        cluster, plan, rows_bytes=mbs * stats.seq * stats.top_k * stats.hidden * (4.0 if fp32 else 2.0), layers=layers
    )
    dp = dp_time(
        cluster,
        plan,
        policy,
        run,
        stage_params=stage_params,
        layers=layers,
        t_fwd=mb.fwd,
        t_bwd=mb.bwd,
        stage_tensors=stage_tensors,
        gather_bytes=gathered_bytes(stats, run, policy),
        units_per_block=modules_per_block(stats) if run.zero3_unit == "linear" else 1,
    )
    return {"tp_comm": tp_comm, "pp_comm": pp_comm, "cp_comm": cp_comm, "ep_comm": ep_comm}, dp


def _memory(
    stats: ModelStats,
    plan: Plan,
    run: RunPolicy,
    policy: StatePolicy,
    *,
    mbs: int,
    layers: int,
    stage_params: float,
    boundary: float,
) -> dict[str, float]:
    """Bytes per device of the busiest stage (module doc): parameters, gradients, optimizer state,
    activations (the first or last stage's, whichever holds more) and buffers."""
    t, p = plan.tp, plan.pp
    # Expert weights are sharded over ep, and ZeRO shards them further over the shard/ep ranks
    # that hold the same experts; everything else over the shard group.
    experts = expert_param_count(stats, tp=t, pp=p, ep=plan.ep) if plan.ep > 1 else 0.0
    states = model_state_bytes(stage_params - experts, policy, zero=plan.zero, shard=plan.shard)
    if stats.lora is not None:  # a frozen base: gradients and optimizer states for the adapters only
        states = lora_state_bytes(stats, policy, stage_params=stage_params - experts, zero=plan.zero, shard=plan.shard)
    if experts:
        for key, value in model_state_bytes(
            experts, policy, zero=plan.zero, shard=max(1, plan.shard // plan.ep)
        ).items():
            states[key] += value
    kept, replay = layer_bytes(stats, plan, run)
    per_layer = kept * mbs + weight_copy_bytes(stats, plan, run, policy)
    first_in_flight, last_in_flight = _in_flight(plan)
    logits_kept, logits_transient = logits_bytes(stats, plan, run, mbs=mbs)
    transient = replay * mbs  # one layer replayed at a time during backward
    first = first_in_flight * layers * per_layer + transient + boundary + (logits_kept if p == 1 else 0.0)
    last = last_in_flight * layers * per_layer + transient + boundary + logits_kept * last_in_flight
    activations = max(first, last)
    buffers = buffer_bytes(stats, plan, policy, run, layers=layers, boundary=boundary, stage_params=stage_params)
    memory = {
        "params": states["params"],
        "grads": states["grads"],
        "optimizer": states["optimizer"],
        "activations": activations,
        "buffers": buffers,
    }
    if p == 1 or last >= first:  # the loss runs on the busiest stage
        if run.chunked_loss:
            return _chunked_peak(stats, plan, run, memory, mbs=mbs, boundary=boundary)
        memory["buffers"] += logits_transient  # the logits' gradient at the start of the last stage's backward
    return memory


def _chunked_peak(
    stats: ModelStats, plan: Plan, run: RunPolicy, memory: dict[str, float], *, mbs: int, boundary: float
) -> dict[str, float]:
    """The busiest moment of a stage that runs the chunked loss (:func:`chunked_loss_bytes`): its
    forward or its backward, with every activation and the gradients that exist before this
    microbatch's backward (those of earlier microbatches, or DDP's persistent buckets; none for
    one microbatch otherwise), or the end of backward (every gradient, the activations freed but
    the last block input), whichever holds more."""
    _, forward, backward = chunked_loss_bytes(stats, plan, run, mbs=mbs)
    grads = memory["grads"]
    persistent = plan.microbatches > 1 or (plan.zero <= 1 and plan.dp * plan.shard > 1)
    before = grads if persistent else 0.0
    at_loss = before + memory["activations"] + max(forward, backward)
    if at_loss >= grads + boundary:
        return {**memory, "grads": before, "buffers": memory["buffers"] + max(forward, backward)}
    return {**memory, "activations": boundary}


def _context_parallel(
    stats: ModelStats,
    cluster: ClusterSpec,
    plan: Plan,
    *,
    global_batch: int,
    policy: StatePolicy | None,
    headroom: float,
    run: RunPolicy | None,
) -> Estimate:
    """A ``cp`` plan priced as what it runs: ``cp`` ranks per sample, each with a ``1/cp`` slice of
    the sequence that attends to all of it (:func:`~shardwise.plan.stats.slice_stats`), so the
    data-parallel work is ``global_batch x cp`` slices over ``dp x shard x cp`` ranks; the
    parameters are sharded (ZeRO) and the gradients reduced over those ranks too (cp is folded
    into the shard dimension), and every layer all-gathers the keys and values of its ``cp``
    slices (:func:`~shardwise.plan.comm.cp_time`)."""
    from dataclasses import replace

    folded = (
        replace(plan, cp=1, shard=plan.shard * plan.cp) if plan.zero > 0 else replace(plan, cp=1, dp=plan.dp * plan.cp)
    )
    run = replace(run or RunPolicy(), context_parallel=plan.cp)
    est = estimate(
        slice_stats(stats, plan.cp),
        cluster,
        folded,
        global_batch=global_batch * plan.cp,
        policy=policy,
        headroom=headroom,
        run=run,
    )
    return replace(est, plan=plan, global_batch=global_batch)
