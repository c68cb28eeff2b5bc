"""One transformer layer's kernels on a preset (the compute model of :mod:`shardwise.plan.compute`,
whose module doc derives each term): the roofline of a GEMM (16-bit or FP8), the layer's GEMMs
with FP8's casts, the attention core (fused or eager) and the pointwise work at memory bandwidth.
"""

from __future__ import annotations

from shardwise.layout import Plan
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.policy import RunPolicy
from shardwise.plan.stats import ModelStats

# Bytes per attention score that eager attention moves (16-bit), (forward, backward), by (fused
# softmax, dropout): Megatron-LM's fused scale-mask-softmax kernel writes and reads the scores once
# per op (the bmm writes 2, the softmax reads 2 and writes 2, dropout reads 2 and writes 2 + a 1-byte
# mask, the second bmm reads 2); plain torch ops (a model's own eager attention) add the scaling and
# the causal mask as two more read-write passes, forward and backward.
EAGER_SCORE_BYTES = {
    (True, False): (8.0, 10.0),
    (True, True): (13.0, 15.0),
    (False, False): (16.0, 18.0),
    (False, True): (21.0, 23.0),
}
FP8_MULTIPLE = 16  # torch._scaled_mm needs both dimensions of each operand to be multiples of 16
# Bytes moved per element by torchao's casts for FP8 training, per recipe (its roofline model,
# torchao/testing/training/roofline_utils.py): (input or output gradient, weight), forward and
# backward together.
FP8_CAST_BYTES = {"tensorwise": (6.0, 8.0), "rowwise": (8.0, 10.0)}
GEMM_K0 = 128  # a GEMM tile's fixed prologue/epilogue, in inner-dimension elements (about two k-steps of 64)
CAUSAL_BLOCK = 128  # query/key tile of FlashAttention's causal kernel


def gemm_time(
    cluster: ClusterSpec,
    m: float,
    n: float,
    k: float,
    *,
    peak: float,
    elem: float,
    efficiency: float | None = None,
    out_elem: float | None = None,
) -> float:
    """Roofline time of one ``(m x k) @ (k x n)`` GEMM with ``elem``-byte operands (and
    ``out_elem``-byte output, default ``elem``)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    # Each output tile runs k / k_step steps plus a fixed prologue and epilogue, so a short inner
    # dimension reaches less of the peak: efficiency x k / (k + GEMM_K0).
    compute = 2 * m * n * k / (peak * (efficiency or cluster.gemm_efficiency_)) * (k + GEMM_K0) / k
    memory = (elem * (m * k + k * n) + (out_elem or elem) * m * n) / (cluster.memory_bw * cluster.memory_efficiency)
    return max(compute, memory)


def fp8_gemm_time(cluster: ClusterSpec, m: float, n: float, k: float) -> float:
    """One FP8 GEMM (``torch._scaled_mm``): 1-byte operands, a 16-bit output, at the FP8 peak
    times the chip's FP8 GEMM efficiency."""
    return gemm_time(
        cluster, m, n, k, peak=cluster.peak("fp8"), elem=1.0, efficiency=cluster.fp8_gemm_efficiency_, out_elem=2.0
    )


def layer_gemms(
    stats: ModelStats,
    cluster: ClusterSpec,
    plan: Plan,
    run: RunPolicy,
    *,
    tokens: int,
    peak: float,
    c: float,
    bw: float,
    fp8: bool,
) -> tuple[list[float], float, float, float]:
    """One layer's GEMMs: each forward GEMM's seconds (in forward order, for the per-op recompute
    policy), the backward GEMMs' seconds, and FP8's casts forward and backward."""
    t = plan.tp
    h, f, kv = stats.hidden, stats.ffn, stats.kv_hidden or stats.hidden
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
    # The block's own Linear layers (an MoE layer's router among them; its experts are 3-D weights)
    dense = len(proj) + 1 + (1 if stats.experts else (3 if stats.gated_mlp else 2))
    # Under FSDP with FP8 all-gather (tensorwise) each rank casts its weight shard once per step
    # before the gather (amax + cast: 5 bytes per element of the 1/shard) and backward transposes
    # the gathered FP8 weight (read 1, write 1); otherwise every forward casts the whole weight.
    gathered_fp8 = run.fp8_all_gather and run.fp8_recipe == "tensorwise" and plan.zero >= 2 and plan.shard > 1
    weight_cast = (5.0 / plan.shard / max(1, plan.microbatches) + 2.0) if gathered_fp8 else None
    # Compiled (Plan.compile), the amax pass over an input or output gradient fuses into the op
    # that produced it (torchao's roofline, fuse_with_prev: 4 bytes where eager moves 6) and the
    # separate q, k, v projections share one cast of their common input (identical ops, one kernel).
    fused_casts = plan.compile
    gemms, gemm_bwd, casts_fwd, casts_bwd = [], 0.0, 0.0, 0.0
    for i, (m_, (k_, n_)) in enumerate(zip(rows, shapes)):
        # Forward (m x k) @ (k x n); backward the data gradient (m x n) @ (n x k) and the weight
        # gradient (k x m) @ (m x n). FP8 for the Linear layers whose shapes the kernels take (an
        # MoE layer's grouped expert GEMMs stay bf16: torchao's float8 converts nn.Linear layers).
        if fp8 and i < dense and k_ % FP8_MULTIPLE == 0 and n_ % FP8_MULTIPLE == 0:
            gemms.append(fp8_gemm_time(cluster, m_, n_, k_))
            gemm_bwd += fp8_gemm_time(cluster, m_, k_, n_) + fp8_gemm_time(cluster, k_, n_, m_)
            act, weight = FP8_CAST_BYTES[run.fp8_recipe]
            weight = weight if weight_cast is None else weight_cast
            act -= 2.0 if fused_casts else 0.0
            shared = fused_casts and stats.qkv_input_copies > 1 and 0 < i < len(proj)  # k and v reuse q's input cast
            casts_fwd += (
                (0.0 if shared else act * m_ * k_) + weight * k_ * n_
            ) / bw  # the input's and the weight's casts
            casts_bwd += act * m_ * n_ / bw  # the output gradient's
        else:
            gemms.append(gemm_time(cluster, m_, n_, k_, peak=peak, elem=c))
            gemm_bwd += gemm_time(cluster, m_, k_, n_, peak=peak, elem=c) + gemm_time(
                cluster, k_, n_, m_, peak=peak, elem=c
            )
    return gemms, gemm_bwd, casts_fwd, casts_bwd


def attention_core(
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
) -> tuple[float, float, float]:
    """The attention core of one layer: forward and backward seconds, and the forward's traffic
    over the scores (eager attention; what recomputing the softmax replays)."""
    t, s, h = plan.tp, stats.seq, stats.hidden
    # -- attention core --------------------------------------------------------------------------
    heads_local = max(stats.heads // t, 1) if stats.heads else 1
    head_dim = h / max(stats.heads, 1)
    ctx = stats.context or s  # keys per query (context parallelism: the whole sequence)
    if stats.attention == "eager":
        batch = mbs * heads_local
        attn_fwd = batch * (
            gemm_time(cluster, s, ctx, head_dim, peak=peak, elem=c)
            + gemm_time(cluster, s, head_dim, ctx, peak=peak, elem=c)
        )
        scores = mbs * heads_local * s * ctx * (c / 2)
        fwd_bytes, bwd_bytes = EAGER_SCORE_BYTES[(run.fused_softmax, stats.dropout)]
        attn_fwd_traffic = scores * fwd_bytes / bw
        attn_bwd = 2 * attn_fwd + scores * bwd_bytes / bw
        attn_fwd += attn_fwd_traffic
    else:
        causal = min(1.0, (1 + CAUSAL_BLOCK / ctx) / 2)
        flops = 4 * tokens * ctx * h / t * causal
        rate = peak * cluster.attention_efficiency_
        attn_fwd, attn_bwd = flops / rate, 2.5 * flops / rate
        attn_fwd_traffic = 0.0
    return attn_fwd, attn_bwd, attn_fwd_traffic


def pointwise_work(
    stats: ModelStats, plan: Plan, *, tokens: int, c: float, r: float, bw: float, autocast: bool
) -> tuple[float, float]:
    """One layer's pointwise work (norms, residual adds, the activation, dropout, rotary, autocast's
    casts): forward and backward seconds at the memory bandwidth."""
    t, h, f, kv = plan.tp, stats.hidden, stats.ffn, stats.kv_hidden or stats.hidden
    # -- pointwise work of one layer, forward (bytes) ---------------------------------------------
    shard_norm = t if plan.sequence_parallel else 1
    norms = 2 * (r + c) * h / shard_norm
    adds = 2 * (2 * r + c) * h / shard_norm
    act = (
        (5 if stats.gated_mlp else 2)
        * c
        * (stats.top_k * stats.expert_ffn / (1 if plan.ep > 1 else t) if stats.experts else f / t)
    )
    drop = 2 * (2 * c + 1) * h / shard_norm if stats.dropout else 0.0
    rotary = 2 * c * (h + kv) / t if stats.rotary else 0.0
    casts = 0.0
    if autocast:  # each projection casts its fp32 input (the norm's output) to 16 bits: read 4, write 2
        casts = 6.0 * (h * stats.qkv_input_copies + h) / shard_norm
    pointwise_fwd = tokens * (norms + adds + act + drop + rotary + casts) / bw
    # Backward moves the same bytes once more, plus what each gradient kernel reads beside its
    # incoming gradient: a norm's input (read x and the gradient, write the input's gradient:
    # 2 r + c where forward moved r + c) and the activation function's input (GELU: read the
    # gradient and the input, write one: 3 c per element where forward moved 2 c). A residual add's
    # gradient is the incoming one (its accumulation is counted like the forward add), dropout's
    # reads the mask, a cast's casts back.
    act_elems = stats.top_k * stats.expert_ffn / (1 if plan.ep > 1 else t) if stats.experts else f / t
    pointwise_bwd = pointwise_fwd + tokens * (2 * r * h / shard_norm + c * act_elems) / bw
    if autocast and plan.zero <= 1:  # autocast casts every weight once per microbatch: read 4, write 2
        pointwise_fwd += 6.0 * stats.params_per_block / t / bw
        pointwise_bwd += 6.0 * stats.params_per_block / t / bw  # and each weight's gradient back to fp32
    return pointwise_fwd, pointwise_bwd


__all__ = [
    "CAUSAL_BLOCK",
    "EAGER_SCORE_BYTES",
    "FP8_CAST_BYTES",
    "FP8_MULTIPLE",
    "GEMM_K0",
    "attention_core",
    "fp8_gemm_time",
    "gemm_time",
    "layer_gemms",
    "pointwise_work",
]
