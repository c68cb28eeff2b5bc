"""The cost model's physical terms one by one: memory by precision policy and recompute mode, the
logits counted once, ZeRO-3's gather unit and prefetch, link volumes of collectives across nodes,
the overlap fraction, pipeline sends in the activation dtype, and compute that depends on GEMM
shapes and sequence length."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.layout import Plan
from shardwise.plan.cluster import PRESETS, resolve
from shardwise.plan.comm import exposed
from shardwise.plan.cost import estimate
from shardwise.plan.memory import StatePolicy, layer_bytes, logits_bytes
from shardwise.plan.policy import RunPolicy
from shardwise.plan.stats import TransformerSpec, transformer_stats

SIXTEEN = RunPolicy.sixteen_bit()
LLAMA_8B = TransformerSpec(
    layers=32,
    hidden=4096,
    heads=32,
    kv_heads=8,
    ffn=14336,
    vocab_size=128256,
    seq_len=8192,
    bias=False,
    learned_positions=False,
    separate_qkv=True,
)


def _gpt(**kw: object) -> TransformerSpec:
    return TransformerSpec(**{"layers": 8, "hidden": 1024, "heads": 16, "vocab_size": 32000, "seq_len": 2048, **kw})


def test_sixteen_bit_policy_keeps_korthikanti_bytes_and_autocast_keeps_more() -> None:
    """16-bit activations: 32 s h per layer with fused attention (no dropout), 34 s h + 5 a s^2 with
    eager attention and dropout (Korthikanti et al. 2022 eq. 1); autocast adds its fp32 residual
    stream (LayerNorm inputs: 2 s h x 2 bytes) and separate q/k/v copies."""
    s, h = 2048, 1024
    fused = transformer_stats(_gpt())
    kept, replay = layer_bytes(fused, Plan(precision="bf16"), SIXTEEN)
    assert kept == pytest.approx(32 * s * h) and replay == 0
    eager = transformer_stats(_gpt(attention="eager", dropout=0.1))
    assert layer_bytes(eager, Plan(precision="bf16"), SIXTEEN)[0] == pytest.approx(s * h * (34 + 5 * 16 * s / h))
    autocast = layer_bytes(transformer_stats(_gpt(separate_qkv=True)), Plan(precision="bf16"), RunPolicy.shardwise())[0]
    assert autocast == pytest.approx(32 * s * h + 4 * s * h + 2 * 2 * s * h)  # fp32 x and x2; two more copies of n1


def test_recompute_modes_order_memory_and_time() -> None:
    """full < op (torchtitan: every other matmul) < matmuls (shardwise: every matmul) < none in kept
    bytes; the replayed work in the opposite order; selective of the attention core saves nothing
    with fused attention."""
    stats = transformer_stats(LLAMA_8B, gated_mlp=True)
    plan = Plan(precision="bf16")
    kept = {m: layer_bytes(stats, plan, SIXTEEN, mode=m)[0] for m in ("none", "attention", "matmuls", "op", "full")}
    assert kept["full"] < kept["op"] < kept["matmuls"] < kept["none"] == kept["attention"]
    s, h, kv, f = 8192, 4096, 1024, 14336
    # torchtitan's op policy saves the block input, wq, wv, the attention output, w1 and w2 outputs
    assert kept["op"] == pytest.approx(2 * s * (h + h + kv + h + f + h))
    assert kept["full"] == pytest.approx(2 * s * h)
    cluster = resolve("a100-80gb", devices=64)
    steps = [estimate(stats, cluster, Plan(zero=3, shard=64, precision="bf16", recompute=r), global_batch=64,
                      run=replace(SIXTEEN, selective=m)).step_time_s
             for m, r in (("attention", "none"), ("matmuls", "selective"), ("op", "selective"), ("attention", "full"))]
    assert steps == sorted(steps) and len(set(steps)) == 4


def test_logits_and_the_fp32_loss_copy_are_counted_once() -> None:
    """A fused loss keeps one 4-byte copy per logit and computes the gradient in place; autocast's
    F.cross_entropy keeps only the fp32 log-softmax (4 bytes: the logits are freed once the loss is
    computed) and allocates nll_loss's and log_softmax's gradients (4 + 4) at the start of backward
    (measured on CPU, bench/runtime_options.py)."""
    stats = transformer_stats(_gpt())
    elems = 2048 * 32000
    plan = Plan(precision="bf16")
    assert logits_bytes(stats, plan, SIXTEEN) == (pytest.approx(4 * elems), 0.0)
    assert logits_bytes(stats, plan, RunPolicy.shardwise()) == (pytest.approx(4 * elems), pytest.approx(8 * elems))
    assert logits_bytes(stats, Plan(), RunPolicy.shardwise()) == (
        pytest.approx(4 * elems),
        pytest.approx(8 * elems),
    )  # fp32 too
    # on the last pipeline stage the schedule's forward cache also holds the (16-bit) logits
    assert logits_bytes(stats, Plan(pp=2, precision="bf16"), RunPolicy.shardwise())[0] == pytest.approx(6 * elems)
    cluster = resolve("h100", devices=1)
    fused = estimate(stats, cluster, plan, global_batch=4, run=SIXTEEN)
    unfused = estimate(stats, cluster, plan, global_batch=4, run=replace(SIXTEEN, fused_loss=False))
    assert unfused.memory_total - fused.memory_total == pytest.approx(4 * (4 + 8 - 4) * elems)


def test_pipeline_logits_live_on_the_last_stage_only() -> None:
    """The first stage holds p microbatches of activations, the last one microbatch plus the logits:
    the busiest stage is the larger of the two, never their sum."""
    stats = transformer_stats(_gpt(vocab_size=256000))
    cluster = resolve("a100-80gb", devices=4)
    est = estimate(stats, cluster, Plan(pp=4, microbatches=8, precision="bf16"), global_batch=8, run=SIXTEEN)
    per_layer = layer_bytes(stats, Plan(pp=4, precision="bf16"), SIXTEEN)[0]
    first = 4 * 2 * per_layer + 2048 * 1024 * 2
    last = 1 * 2 * per_layer + 2048 * 1024 * 2 + logits_bytes(stats, Plan(precision="bf16"), SIXTEEN)[0]
    assert est.memory["activations"] == pytest.approx(max(first, last))


def test_zero3_holds_one_unit_and_its_prefetched_successor() -> None:
    """FSDP gathers a block and prefetches the next (2 blocks of 16-bit parameters), holds one block's
    unsharded gradients, and keeps the root unit (embeddings, head) gathered; not the whole model."""
    stats = transformer_stats(_gpt(layers=24))
    cluster = resolve("a100-80gb", devices=8)
    est = estimate(stats, cluster, Plan(zero=3, shard=8, precision="bf16"), global_batch=8, run=SIXTEEN)
    block, root = stats.params_per_block, stats.params_embed + stats.params_head
    assert est.memory["buffers"] == pytest.approx(2 * 2 * block + 4 * block + 2 * root)
    # DeepSpeed's ZeRO-3 fetches per module: the largest weight matrix and the prefetched next one
    deepspeed = estimate(
        stats,
        cluster,
        Plan(zero=3, shard=8, precision="bf16"),
        global_batch=8,
        run=replace(SIXTEEN, zero3_unit="linear"),
    )
    linear = 1024 * 4096
    assert deepspeed.memory["buffers"] == pytest.approx(2 * 2 * linear + 4 * linear + 2 * root)
    # shardwise accumulates unsharded gradients over microbatches (FSDP2 without gradient sync): one more full gradient
    two = estimate(stats, cluster, Plan(zero=3, shard=8, precision="bf16", microbatches=2), global_batch=16)
    one = estimate(stats, cluster, Plan(zero=3, shard=8, precision="bf16"), global_batch=8)
    assert two.memory["buffers"] - one.memory["buffers"] == pytest.approx(4 * stats.params_total * 7 / 8, rel=1e-6)


def test_collectives_across_nodes_use_every_nic_of_the_node() -> None:
    """A ring over 16 ranks in 2 nodes of 8 crosses each node once per ring, and NCCL runs a ring per
    NIC: the node's 8 NICs share the traffic. A group of one rank per node (data parallelism across
    tensor-parallel nodes) has one NIC per rank."""
    c = resolve("a100-80gb", devices=64, devices_per_node=8)
    nbytes, f = 1e9, 15 / 16
    full = c.collective_time("all_gather", nbytes, 16, stride=1, latency=False)
    assert full == pytest.approx(f * nbytes / min(c.intra_bw, 8 * c.inter_bw))
    strided = c.collective_time("all_gather", nbytes, 8, stride=8, latency=False)
    assert strided == pytest.approx(7 / 8 * nbytes / c.inter_bw)
    assert strided > 5 * full
    # ring latency: n - 1 steps for an all-gather, ceil(log2 n) for an all-reduce (tree)
    assert c.collective_time("all_gather", 1.0, 64) == pytest.approx(
        (64 - 1 - 8) * c.intra_latency_s + 8 * c.inter_latency_s, rel=1e-3
    )
    assert c.collective_time("all_reduce", 1.0, 64) == pytest.approx(6 * c.inter_latency_s, rel=1e-3)


def test_overlapped_traffic_costs_its_contention() -> None:
    c = replace(PRESETS["a100-80gb"], overlap=0.6)
    assert exposed(c, 1.0, 10.0) == pytest.approx(0.4)  # hidden, but slows the kernels beside it
    assert exposed(c, 10.0, 4.0) == pytest.approx(6.0 + 0.4 * 4.0)
    assert exposed(replace(c, overlap=0.0), 3.0, 10.0) == 3.0
    assert exposed(replace(c, overlap=1.0), 3.0, 10.0) == 0.0
    assert 0 < PRESETS["a100-80gb"].overlap < 1 and 0 < PRESETS["h100"].overlap < 1


def test_pipeline_sends_are_charged_in_the_activation_dtype() -> None:
    """16-bit activations send 2 bytes per element, autocast's fp32 residual stream 4; Megatron's
    scatter/gather (or sequence parallelism) sends 1/t per tensor-parallel rank."""
    stats = transformer_stats(_gpt())
    cluster = replace(resolve("a100-80gb", devices=16, devices_per_node=8), inter_latency_s=0.0, intra_latency_s=0.0)
    plan = Plan(pp=2, dp=8, microbatches=4, precision="bf16")
    sixteen = estimate(stats, cluster, plan, global_batch=32, run=replace(SIXTEEN, pp_scatter_gather=False)).detail[
        "pp_comm"
    ]
    autocast = estimate(stats, cluster, plan, global_batch=32, run=RunPolicy.shardwise()).detail["pp_comm"]
    assert autocast == pytest.approx(2 * sixteen)
    assert sixteen == pytest.approx(2 * (4 + 1) * 2048 * 1024 * 2 / cluster.inter_bw)
    tp = Plan(pp=2, tp=8, microbatches=4, precision="bf16")
    gathered = estimate(stats, cluster, tp, global_batch=4, run=SIXTEEN).detail["pp_comm"]
    whole = estimate(stats, cluster, tp, global_batch=4, run=replace(SIXTEEN, pp_scatter_gather=False)).detail[
        "pp_comm"
    ]
    assert whole == pytest.approx(8 * gathered)


def test_compute_efficiency_depends_on_gemm_shapes_and_sequence_length() -> None:
    """Small hidden sizes spend more of the step outside the GEMMs (pointwise work, the loss over the
    vocabulary), so their MFU is lower; long sequences are dominated by attention at its own (lower)
    efficiency, so the time per token grows linearly with the sequence length."""
    cluster = resolve("a100-40gb", devices=1)
    mfu = {}
    for h in (768, 2048, 5120):
        stats = transformer_stats(TransformerSpec(layers=24, hidden=h, heads=h // 128, vocab_size=50368, seq_len=2048))
        mfu[h] = estimate(stats, cluster, Plan(precision="bf16"), global_batch=8, run=SIXTEEN).mfu
    assert mfu[768] < mfu[2048] < mfu[5120] < cluster.gemm_efficiency
    per_token = {}
    for s in (2048, 8192, 32768):
        stats = transformer_stats(TransformerSpec(layers=24, hidden=2048, heads=16, vocab_size=50368, seq_len=s))
        est = estimate(stats, cluster, Plan(precision="bf16"), global_batch=1, run=SIXTEEN)
        per_token[s] = est.detail["microbatch"] / s  # the compute of one sequence (the optimizer step is per step)
    slope_lo = (per_token[8192] - per_token[2048]) / 6144
    slope_hi = (per_token[32768] - per_token[8192]) / 24576
    assert slope_lo > 0 and slope_hi == pytest.approx(slope_lo, rel=0.15)
    assert est.detail["compute_attention"] > 0.5 * est.step_time_s  # at 32k tokens


def test_fp8_linears_run_at_the_fp8_rate() -> None:
    stats = transformer_stats(LLAMA_8B, gated_mlp=True)
    cluster = resolve("h100", devices=8)
    plan = Plan(zero=3, shard=8, precision="bf16")
    bf16 = estimate(stats, cluster, plan, global_batch=8, run=SIXTEEN)
    fp8 = estimate(stats, cluster, plan, global_batch=8, run=replace(SIXTEEN, linear_dtype="fp8"))
    assert 1.6 < bf16.detail["compute_gemm"] / fp8.detail["compute_gemm"] < 2.0  # 2x the peak, less the casts
    assert fp8.detail["compute_attention"] == bf16.detail["compute_attention"]


def test_megatron_state_policy_and_gated_mlp_parameters() -> None:
    policy = StatePolicy.megatron()
    assert (policy.param, policy.grad, policy.optimizer) == (2.0, 4.0, 12.0)
    stats = transformer_stats(LLAMA_8B, gated_mlp=True)
    assert stats.params_total / 1e9 == pytest.approx(8.03, abs=0.01)  # Llama 3 8B
    assert stats.flops_per_block == pytest.approx(
        2 * 8192 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 4 * 8192**2 * 4096
    )
