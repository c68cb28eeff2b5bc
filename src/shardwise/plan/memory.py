"""The memory terms of the cost model: model states by ZeRO stage and state policy, the busiest
rank's parameter count, what one layer keeps for backward under each recompute mode and precision
policy (:mod:`shardwise.plan.activations`), the logits, and communication buffers.
:func:`shardwise.plan.cost.estimate` combines them per pipeline stage (the first stage holds the
most microbatches in flight, the last one the logits) and takes the busiest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.plan.activations import layer_bytes, layer_tensors, recompute_mode
from shardwise.plan.policy import RunPolicy
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
    def torch(cls, precision: str = "fp32", optimizer: str = "adam", *, reduce_bytes: float = 4.0) -> StatePolicy:
        """shardwise / FSDP: the fp32 parameter is the master copy (autocast or FSDP's 16-bit
        all-gather make transient compute copies): ``P = G = 4``, Adam ``K = 8``. ``reduce_bytes``:
        2 for a 16-bit gradient reduction (llm-foundry's FSDP ``mixed_precision=PURE``)."""
        # muon: one momentum on the matrices (shardwise.plan.muon blends in AdamW's 8 for the rest)
        states = {"adam": 8.0, "adamw": 8.0, "sgd": 4.0, "sgd_nomomentum": 0.0, "muon": 4.0}.get(optimizer)
        if states is None:
            raise ConfigError(
                f"optimizer {optimizer!r} is unknown to the cost model",
                hint="use adam, adamw, muon, sgd or sgd_nomomentum",
            )
        compute = 4.0 if precision == "fp32" else 2.0
        return cls(
            param=4.0,
            grad=4.0,
            optimizer=states,
            compute_bytes=compute,
            reduce_bytes=reduce_bytes,
            zero2_shards_params=True,
        )

    @classmethod
    def zero_paper(cls, k: float = 12.0) -> StatePolicy:
        """ZeRO's mixed-precision Adam (Rajbhandari et al. 2020, sec. 3.1): fp16 params and grads
        (2 + 2), K = 12 (fp32 master weights, momentum and variance)."""
        return cls(param=2.0, grad=2.0, optimizer=k, compute_bytes=2.0, reduce_bytes=2.0)

    @classmethod
    def megatron(cls) -> StatePolicy:
        """Megatron-LM / DeepSpeed's BF16 optimizer: 16-bit model parameters (2), fp32 gradient
        accumulation buffers (4, all-reduced in fp32), fp32 master weights + Adam moments (12);
        its distributed optimizer is ZeRO-1 (the 12 bytes sharded)."""
        return cls(param=2.0, grad=4.0, optimizer=12.0, compute_bytes=2.0, reduce_bytes=4.0)

    @classmethod
    def named(cls, name: str, *, precision: str, optimizer: str) -> StatePolicy:
        """``--memory-convention``: ``torch`` (shardwise's FSDP/autocast), ``zero-paper``, ``megatron``."""
        if name == "torch":
            return cls.torch(precision, optimizer)
        if name == "zero-paper":
            return cls.zero_paper()
        if name == "megatron":
            return cls.megatron()
        raise ConfigError(f"--memory-convention {name!r} is unknown", hint="use torch, zero-paper or megatron")


def model_state_bytes(params: float, policy: StatePolicy, *, zero: int, shard: int) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer states for ``params`` on this rank."""
    n = max(1, shard)
    return {
        "params": policy.param * params / (n if zero >= 3 or (zero == 2 and policy.zero2_shards_params) else 1),
        "grads": policy.grad * params / (n if zero >= 2 else 1),
        "optimizer": policy.optimizer * params / (n if zero >= 1 else 1),
    }


def stage_param_count(stats: ModelStats, *, tp: int, pp: int, ep: int = 1) -> float:
    """Parameters on the busiest rank before ZeRO: its pipeline stage's share, sharded ``1/tp``
    except what tensor parallelism replicates (norms, some biases, position embeddings); the
    experts of MoE layers ``1/ep`` under expert parallelism (replicated over tp), else ``1/tp``."""
    layers = math.ceil(stats.blocks / pp)

    def local(total: float, replicated: float) -> float:
        return (total - replicated) / tp + replicated

    dense = stats.params_per_block - stats.expert_params_per_block
    blocks = layers * (local(dense, stats.replicated_per_block) + stage_expert_share(stats, tp=tp, ep=ep))
    embed = local(stats.params_embed, stats.replicated_embed)
    head = local(stats.params_head, stats.replicated_head)
    first = blocks + embed + (head if pp == 1 else 0.0)
    last = blocks + head + (embed if stats.tied_embeddings and pp > 1 else 0.0)
    return max(first, last)


def stage_expert_share(stats: ModelStats, *, tp: int, ep: int) -> float:
    """One block's expert weights on a rank: ``1/ep`` under expert parallelism, else ``1/tp``."""
    return stats.expert_params_per_block / (ep if ep > 1 else tp)


def expert_param_count(stats: ModelStats, *, tp: int, pp: int, ep: int) -> float:
    """The expert weights among :func:`stage_param_count` (ZeRO shards them over ``shard / ep``)."""
    return math.ceil(stats.blocks / pp) * stage_expert_share(stats, tp=tp, ep=ep)


def logits_bytes(stats: ModelStats, plan: Plan, run: RunPolicy, *, mbs: int = 1) -> tuple[float, float]:
    """(kept, transient) bytes of the loss on the last stage for a microbatch of ``mbs`` samples
    (``N`` tokens, ``d`` hidden, ``V/t`` vocabulary entries on this rank, ``c`` the compute dtype):

    - fused (Megatron's vocabulary-parallel cross-entropy keeps the fp32 softmax, the 16-bit logits
      freed once cast; flash-attn's fused cross-entropy keeps the 16-bit logits and a per-token
      log-sum-exp): one copy, 4 bytes per element, its gradient computed in place;
    - unfused (``F.cross_entropy``, in fp32 under autocast, as ``log_softmax`` + ``nll_loss``): kept
      is the fp32 log-softmax (4 bytes; its backward needs only its output, so the logits
      themselves are freed once the loss is computed, and autocast's fp32 copy of 16-bit logits
      is saved by nothing); at the start of backward ``nll_loss``'s gradient and
      ``log_softmax``'s gradient (4 + 4 bytes) exist beside it, in every precision (12 bytes per
      element at the peak). On the last pipeline stage ``torch.distributed.pipelining`` keeps the
      stage's output, the logits in the compute dtype (``c``), in its forward cache until that
      microbatch's backward. Under tensor parallelism without a vocabulary-parallel loss
      (``RunPolicy.loss_parallel``, off in shardwise's default TP styles) over the whole vocabulary;
    - chunked (``Plan.chunked_loss``): :func:`chunked_loss_bytes`; the transient here is the larger
      of its forward and backward peaks (:func:`shardwise.plan.cost.estimate` takes them apart).
    """
    vocab_local = stats.logits_bytes / 2 / stats.seq / plan.tp  # vocabulary entries of one token on this rank
    tokens = mbs * stats.seq
    fp32 = plan.precision == "fp32"
    c = 4.0 if fp32 else 2.0
    if run.chunked_loss:
        kept, forward, backward = chunked_loss_bytes(stats, plan, run, mbs=mbs)
        return kept, max(forward, backward)
    # without a vocabulary-parallel loss every tensor-parallel rank holds the all-gathered logits
    elems = tokens * vocab_local * (1 if run.loss_parallel else plan.tp)
    if run.fused_loss:
        return elems * 4.0, 0.0
    cached = elems * c if plan.pp > 1 else 0.0  # the pipeline schedule's forward cache holds the stage output
    return elems * 4.0 + cached, elems * 8.0


def chunked_loss_bytes(stats: ModelStats, plan: Plan, run: RunPolicy, *, mbs: int = 1) -> tuple[float, float, float]:
    """(kept, forward, backward) bytes of the chunked loss (``Plan.chunked_loss``,
    :mod:`shardwise.parallel.linear_ce`: the head and the cross-entropy ``C = N d / (V/t)`` tokens
    at a time, each chunk's gradients computed in the loss's forward), as its code allocates them,
    with ``N`` tokens, ``d`` hidden, ``V/t`` vocabulary rows on this rank, ``c`` the bytes of the
    matmuls' dtype (autocast's or the weight's), ``p`` of the head's weight and input (4 over fp32
    parameters, 2 under ``params16``):

    - kept from the loss's forward to its backward: the head input's gradient ``dh`` (``p N d``)
      and the weight's gradient ``dW`` (``p V/t d``);
    - forward, beside them and every activation, at its busiest moment (a chunk's ``dW`` matmul):
      the fp32 accumulator of ``dW`` where the saved one is 16-bit (``(4 - p) V/t d``), autocast's
      16-bit copy of the weight (``c V/t d``), the chunk's fp32 logits and, in 16-bit compute, their
      gradient's 16-bit copy (``(4 + 2) C V/t``), and that matmul's output ``G_c^T h_c``
      (``c V/t d``, added into the fp32 accumulator as it is read);
    - backward: the scaled copies it returns, ``dh`` and ``dW`` (``p (N d + V/t d)``).

    No ``[N, V/t]`` tensor either way; the forward peak comes before this microbatch's other
    gradients exist, the backward one as the first of them does."""
    vocab_local = stats.logits_bytes / 2 / stats.seq / plan.tp
    tokens, d = mbs * stats.seq, max(stats.hidden, 1)
    chunk = max(1, min(tokens, math.ceil(tokens * d / max(vocab_local, 1))))
    head = vocab_local * d
    fp32 = plan.precision == "fp32"
    p = 2.0 if run.precision == "16bit" and not fp32 else 4.0  # params16: 16-bit weights, dh and dW
    c = 4.0 if fp32 else 2.0
    cast = c * head if run.autocast and not fp32 else 0.0
    logits = chunk * vocab_local * (4.0 + (2.0 if c == 2.0 else 0.0))
    matmul = c * head
    kept = p * (tokens * d + head)
    return kept, (4.0 - p) * head + cast + logits + matmul, p * (tokens * d + head)


def weight_copy_bytes(stats: ModelStats, plan: Plan, run: RunPolicy, policy: StatePolicy) -> float:
    """Autocast saves its 16-bit copy of each weight for backward, once per microbatch in flight
    (not under FSDP, whose gathered 16-bit parameters are freed or counted as buffers, and not in a
    recomputed block, which saves nothing or only what its policy names: the casts are replayed)."""
    if not run.autocast or plan.precision == "fp32" or policy.param < 4 or plan.zero >= 2:
        return 0.0
    share = {"none": 1.0, "attention": 1.0, "layer": 0.5}.get(recompute_mode(plan, run), 0.0)
    return share * stats.params_per_block / plan.tp * policy.compute_bytes


def linear_fraction(stats: ModelStats) -> float:
    """The share of a block's parameters in its linear layers (what FP8 training converts): all
    but the norms and the biases tensor parallelism replicates."""
    if stats.params_per_block <= 0:
        return 0.0
    return max(0.0, 1.0 - stats.replicated_per_block / stats.params_per_block)


def modules_per_block(stats: ModelStats) -> int:
    """Modules with parameters in one block: the attention projections (q, k, v separate or fused,
    the output), the MLP's matrices (or the router and the experts) and the two norms."""
    attention = (3 if stats.qkv_input_copies > 1 else 1) + 1
    mlp = 2 if stats.experts else (3 if stats.gated_mlp else 2)
    return attention + mlp + 2


def gathered_bytes(stats: ModelStats, run: RunPolicy, policy: StatePolicy) -> float:
    """Bytes per parameter of a block as ZeRO-3 / FSDP gathers it: the compute dtype, or FP8 for
    the linear weights under torchao's FP8 all-gather (tensorwise scaling only)."""
    if run.fp8 and run.fp8_all_gather and run.fp8_recipe == "tensorwise" and policy.compute_bytes == 2.0:
        lin = linear_fraction(stats)
        return lin * 1.0 + (1 - lin) * policy.compute_bytes
    return policy.compute_bytes


def buffer_bytes(
    stats: ModelStats,
    plan: Plan,
    policy: StatePolicy,
    run: RunPolicy,
    *,
    layers: int,
    boundary: float,
    stage_params: float,
) -> float:
    """Temporary communication buffers of the busiest moment.

    ZeRO-3 gathers one unit (``run.zero3_unit``: a block, as FSDP wraps each block, or DeepSpeed's
    largest weight matrix) and prefetches the next, holds one unit's unsharded gradients before the
    reduce-scatter, and keeps the root unit (embeddings, head) gathered from forward to backward;
    FSDP2's ZeRO-2 keeps every gathered block from forward to backward; accumulating unsharded
    gradients over microbatches (shardwise without ``sharded_accumulation``) keeps a full-size
    gradient; 16-bit parameters without FSDP (``params16`` under DDP/TP: torch's mixed-precision
    replicate) keep the 16-bit compute copy of the stage's weights from forward to backward, as
    FSDP2's ZeRO-2 keeps its gathered blocks; FP8 linears without FSDP's FP8 all-gather cast one
    weight at a time (1 byte per element, transient); TP and PP add their send/receive buffers."""
    block = stats.params_per_block / plan.tp
    root = (stats.params_embed + stats.params_head) / plan.tp
    unit = block
    if run.zero3_unit == "linear" and stats.ffn:  # DeepSpeed fetches module by module: the largest weight matrix
        h, kv, f = stats.hidden, stats.kv_hidden or stats.hidden, stats.ffn
        unit = max(h * (h if stats.qkv_input_copies > 1 else h + 2 * kv), h * f) / plan.tp
    gathered = gathered_bytes(stats, run, policy)
    out = 0.0
    if plan.zero >= 3 and plan.shard > 1:
        out += 2 * unit * gathered + unit * policy.reduce_bytes + root * policy.compute_bytes
    elif plan.zero == 2 and plan.shard > 1:
        if policy.zero2_shards_params:  # FSDP2 keeps every gathered block from forward to backward
            out += layers * block * gathered + root * policy.compute_bytes
        out += block * policy.reduce_bytes  # one reduce-scatter bucket
    elif plan.zero == 1 and plan.shard > 1:
        out += block * policy.param  # the partition being broadcast after the step
    if plan.zero <= 1 and run.precision == "16bit" and policy.param >= 4 and plan.precision != "fp32":
        out += stage_params * policy.compute_bytes  # params16 without FSDP: the 16-bit copy of every weight
    if run.fp8 and not (plan.zero >= 2 and gathered < policy.compute_bytes):
        out += unit * linear_fraction(stats)  # one weight's FP8 cast (torchao saves the 16-bit weight for backward)
    accumulating = plan.microbatches > 1 and plan.zero >= 2 and plan.shard > 1 and not run.sharded_grad_accumulation
    if accumulating:
        out += stage_params * policy.reduce_bytes * (1 - 1 / plan.shard)  # unsharded gradients until the boundary
    if plan.tp > 1:
        out += 2 * boundary  # all-reduce / all-gather output
    if plan.pp > 1:
        out += 2 * boundary / (plan.tp if plan.sequence_parallel else 1)  # send and receive buffers
    return out


__all__ = [
    "StatePolicy",
    "buffer_bytes",
    "chunked_loss_bytes",
    "expert_param_count",
    "gathered_bytes",
    "layer_bytes",
    "layer_tensors",
    "linear_fraction",
    "logits_bytes",
    "model_state_bytes",
    "modules_per_block",
    "recompute_mode",
    "stage_expert_share",
    "stage_param_count",
    "weight_copy_bytes",
]
