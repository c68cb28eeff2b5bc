"""The memory terms of the cost model: model states by ZeRO stage and precision policy, the busiest
rank's parameter count, activations per layer and communication buffers. The formulas and their
sources are in :mod:`shardwise.plan.cost`'s module doc; :func:`shardwise.plan.cost.estimate`
combines these into an :class:`~shardwise.plan.cost.Estimate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.plan.stats import ModelStats


@dataclass(frozen=True)
class StatePolicy:
    """Bytes per parameter of each kind of model state (``optimizer`` includes master weights)."""

    param: float
    grad: float
    optimizer: float
    compute_bytes: float = 4.0  # of a parameter gathered or cast for compute
    reduce_bytes: float = 4.0  # of a gradient element on the wire
    # FSDP2 implements stage 2 as stage 3 that keeps the gathered parameters from forward to
    # backward: the stored parameters are sharded, the gathered copies count as buffers.
    zero2_shards_params: bool = False

    @classmethod
    def torch(cls, precision: str = "fp32", optimizer: str = "adam") -> StatePolicy:
        states = {"adam": 8.0, "adamw": 8.0, "sgd": 4.0, "sgd_nomomentum": 0.0}.get(optimizer)
        if states is None:
            raise ConfigError(f"optimizer {optimizer!r} is unknown to the cost model", hint="use adam, adamw, sgd or sgd_nomomentum")
        compute = 4.0 if precision == "fp32" else 2.0
        return cls(param=4.0, grad=4.0, optimizer=states, compute_bytes=compute, reduce_bytes=4.0, zero2_shards_params=True)

    @classmethod
    def zero_paper(cls, k: float = 12.0) -> StatePolicy:
        """ZeRO's mixed-precision Adam: fp16 params and grads (2 + 2), K = 12 (fp32 master, m, v)."""
        return cls(param=2.0, grad=2.0, optimizer=k, compute_bytes=2.0, reduce_bytes=2.0)


def model_state_bytes(params: float, policy: StatePolicy, *, zero: int, shard: int) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer states for ``params`` on this rank."""
    n = max(1, shard)
    return {
        "params": policy.param * params / (n if zero >= 3 or (zero == 2 and policy.zero2_shards_params) else 1),
        "grads": policy.grad * params / (n if zero >= 2 else 1),
        "optimizer": policy.optimizer * params / (n if zero >= 1 else 1),
    }


def stage_param_count(stats: ModelStats, *, tp: int, pp: int) -> float:
    """Parameters on the busiest rank before ZeRO: its pipeline stage's share, sharded ``1/tp``
    except what tensor parallelism replicates (norms, some biases, position embeddings)."""
    layers = math.ceil(stats.blocks / pp)

    def local(total: float, replicated: float) -> float:
        return (total - replicated) / tp + replicated

    blocks = layers * local(stats.params_per_block, stats.replicated_per_block)
    embed = local(stats.params_embed, stats.replicated_embed)
    head = local(stats.params_head, stats.replicated_head)
    first = blocks + embed + (head if pp == 1 else 0.0)
    last = blocks + head + (embed if stats.tied_embeddings and pp > 1 else 0.0)
    return max(first, last)


def layer_activation(stats: ModelStats, plan: Plan, *, recompute: str | None = None) -> float:
    """Saved bytes of one layer and one sample at 16-bit (Korthikanti et al. 2022, table 2)."""
    recompute = recompute or plan.recompute
    t = plan.tp
    if recompute == "full":
        return stats.boundary_bytes / (t if plan.sequence_parallel else 1)
    total = stats.act_bytes_per_block - (stats.attn_act_bytes_per_block if recompute == "selective" else 0.0)
    if t == 1 or plan.sequence_parallel:
        return total / t
    replicated = min(total, 5 * stats.boundary_bytes)  # 10 s h: LayerNorm inputs and dropout masks
    return replicated + (total - replicated) / t


def autocast_extra(stats: ModelStats, plan: Plan) -> float:
    """Bytes per layer and sample that autocast keeps beyond the 16-bit figure: the fp32 residual
    stream the LayerNorms save (2 more bytes per element) and the extra 16-bit copies of the
    normalized input that separate q/k/v projections save. Divided by ``t`` under sequence
    parallelism, replicated under plain tensor parallelism (like the LayerNorm part in
    :func:`layer_activation`)."""
    elems = stats.residual_elems_per_block + (stats.qkv_input_copies - 1) * stats.boundary_bytes / 2
    extra = 2.0 * elems
    return extra / plan.tp if plan.sequence_parallel else extra


def buffer_bytes(stats: ModelStats, plan: Plan, policy: StatePolicy, *, layers: int, boundary: float) -> float:
    """Temporary communication buffers of the busiest moment."""
    block = stats.params_per_block / plan.tp
    out = 0.0
    if plan.zero >= 3 and plan.shard > 1:
        # FSDP: the unsharded block being computed plus the prefetched next one, and one block's
        # unsharded gradients before the reduce-scatter.
        out += 2 * block * policy.compute_bytes + block * policy.reduce_bytes
    elif plan.zero == 2 and plan.shard > 1:
        if policy.zero2_shards_params:  # FSDP2 keeps every gathered block from forward to backward
            out += layers * block * policy.compute_bytes
        out += block * policy.reduce_bytes  # one reduce-scatter bucket
    elif plan.zero == 1 and plan.shard > 1:
        out += block * policy.param  # the partition being broadcast after the step
    if plan.tp > 1:
        out += 2 * boundary  # all-reduce / all-gather output
    if plan.pp > 1:
        out += 2 * boundary  # send and receive buffers
    return out
