"""The planner in FP8 (issue 25): torchao float8 linears at the FP8 GEMM rate plus their casts, the
LM head and odd shapes in bf16, FSDP's FP8 all-gather, and the search considering fp8 where the
device has FP8 tensor cores. The constants come from documented figures (datasheets, torchao's own
roofline and microbenchmark), not from published runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.cli import main
from shardwise.layout import Plan
from shardwise.plan import auto_plan
from shardwise.plan.cluster import PRESETS, resolve
from shardwise.plan.compute import FP8_CAST_BYTES, fp8_gemm_time, gemm_time
from shardwise.plan.cost import estimate
from shardwise.plan.stats import TransformerSpec, transformer_stats

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


def _linear_speedup(cluster: object, m: int, k: int, n: int, recipe: str = "tensorwise") -> float:
    """bf16 over FP8 time of one linear's forward and backward (three GEMMs) with torchao's casts."""
    def three(f: object) -> float:
        return f(m, n, k) + f(m, k, n) + f(k, n, m)  # forward, data gradient, weight gradient

    bf16 = three(lambda a, b, c: gemm_time(cluster, a, b, c, peak=cluster.peak("bf16"), elem=2.0))
    act, weight = FP8_CAST_BYTES[recipe]
    casts = (act * (m * k + m * n) + weight * k * n) / (cluster.memory_bw * cluster.memory_efficiency)
    return bf16 / (three(lambda a, b, c: fp8_gemm_time(cluster, a, b, c)) + casts)


def test_torchao_microbenchmark_is_reproduced() -> None:
    """torchao/float8/README.md, on an H100 (its roofline's 2.4 TB/s variant): a linear of M, K, N =
    4096, 8192, 16384 runs 1.39x faster in float8 (tensorwise), one of 1024, 2048, 1024 slower
    (0.80x: leave it in bf16)."""
    h100 = replace(PRESETS["h100"], memory_bw=2.4e12)
    assert _linear_speedup(h100, 4096, 8192, 16384) == pytest.approx(1.39, rel=0.05)
    assert _linear_speedup(h100, 1024, 2048, 1024) < 1.0
    assert _linear_speedup(h100, 4096, 8192, 16384, "rowwise") < _linear_speedup(h100, 4096, 8192, 16384)
    assert PRESETS["h100"].fp8_gemm_efficiency == pytest.approx(0.87 * PRESETS["h100"].gemm_efficiency, abs=1e-3)
    assert PRESETS["a100-80gb"].fp8_capable is False and PRESETS["h200"].fp8_capable


def test_fp8_plans_convert_the_block_linears_only() -> None:
    stats = transformer_stats(LLAMA_8B, gated_mlp=True)
    cluster = resolve("h100", devices=8)
    plan = Plan(zero=3, shard=8, precision="bf16", params16=True)
    bf16 = estimate(stats, cluster, plan, global_batch=8)
    fp8 = estimate(stats, cluster, replace(plan, precision="fp8"), global_batch=8)
    assert 1.5 < bf16.detail["compute_gemm"] / fp8.detail["compute_gemm"] < 2.0 and fp8.detail["compute_fp8_casts"] > 0
    assert fp8.detail["compute_attention"] == bf16.detail["compute_attention"]  # attention stays bf16
    assert fp8.detail["compute_head"] == bf16.detail["compute_head"]  # so does the LM head
    assert fp8.memory["activations"] == pytest.approx(bf16.memory["activations"])  # torchao saves the 16-bit tensors
    assert fp8.mfu > bf16.mfu and fp8.mfu == pytest.approx(
        bf16.mfu * bf16.step_time_s / fp8.step_time_s
    )  # against the bf16 peak
    # a layer whose shape is not a multiple of 16 stays bf16: nothing converts at hidden 1000
    odd = transformer_stats(TransformerSpec(layers=4, hidden=1000, heads=8, ffn=4000, vocab_size=32000, seq_len=2048))
    assert estimate(odd, cluster, Plan(precision="fp8", params16=True), global_batch=1).detail[
        "compute_gemm"
    ] == pytest.approx(
        estimate(odd, cluster, Plan(precision="bf16", params16=True), global_batch=1).detail["compute_gemm"]
    )


def test_fsdp_gathers_fp8_weights_for_tensorwise_only() -> None:
    """torchao's FP8 all-gather (tensorwise): each block's linear weights cross the wire and sit in
    the gathered buffers at 1 byte instead of 2; rowwise gathers in bf16."""
    stats = transformer_stats(LLAMA_8B, gated_mlp=True)
    cluster = resolve("h100", devices=16)
    plan = Plan(zero=3, shard=16, precision="bf16", params16=True)
    bf16 = estimate(stats, cluster, plan, global_batch=16)
    tensorwise = estimate(stats, cluster, replace(plan, precision="fp8"), global_batch=16)
    rowwise = estimate(stats, cluster, replace(plan, precision="fp8", fp8_recipe="rowwise"), global_batch=16)
    assert tensorwise.detail["dp_comm"] < 0.85 * bf16.detail["dp_comm"] and rowwise.detail["dp_comm"] == pytest.approx(
        bf16.detail["dp_comm"]
    )
    block = stats.params_per_block
    lin = 1 - stats.replicated_per_block / block
    assert bf16.memory["buffers"] - tensorwise.memory["buffers"] == pytest.approx(
        2 * block * lin, rel=1e-6
    )  # two gathered blocks
    assert rowwise.step_time_s > tensorwise.step_time_s


def test_the_search_considers_fp8_where_the_device_has_it(capsys: pytest.CaptureFixture) -> None:
    spec = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256, "seq": 8192,
            "bias": False, "learned_positions": False}
    assert auto_plan(spec, world_size=64, cluster="h100", global_batch=64).plan.precision == "fp8"
    assert auto_plan(spec, world_size=64, cluster="h100", global_batch=64, precision="bf16").plan.precision == "bf16"
    assert auto_plan(spec, world_size=64, cluster="a100-80gb", global_batch=64).plan.precision == "bf16"
    assert (
        main(
            [
                "plan",
                "--model",
                "gpt3-1.3b",
                "--devices",
                "8",
                "--device-type",
                "h100",
                "--precision",
                "fp8",
                "--top",
                "1",
            ]
        )
        == 0
    )
    assert "precision=fp8" in capsys.readouterr().out
    assert (
        main(["plan", "--model", "gpt3-1.3b", "--devices", "8", "--device-type", "a100-80gb", "--precision", "fp8"])
        == 2
    )
    assert "needs FP8 tensor cores" in capsys.readouterr().err
