"""The planner knows context and expert parallelism: memory and traffic of each, and when it picks them."""

from __future__ import annotations

from dataclasses import replace

import json

import pytest

from shardwise.cli import main
from shardwise.layout import Plan
from shardwise.plan.cluster import resolve
from shardwise.plan.cost import estimate
from shardwise.plan.policy import RunPolicy
from shardwise.plan.search import SearchOptions, search
from shardwise.plan.stats import slice_stats, transformer_stats
from shardwise.shape import TransformerShape

LONG = TransformerShape(layers=32, hidden=4096, heads=32, kv_heads=8, vocab_size=128256, seq_len=262144, ffn=14336,
                        learned_positions=False, bias=False, name="llama-8b-256k")
MOE = TransformerShape(layers=32, hidden=4096, heads=32, kv_heads=8, vocab_size=32000, seq_len=4096, experts=8, top_k=2,
                       expert_ffn=14336, learned_positions=False, bias=False, name="mixtral-like")


def test_a_slice_is_a_cp_th_of_every_per_token_figure() -> None:
    full = transformer_stats(LONG, gated_mlp=True)
    part = slice_stats(full, 4)
    assert part.seq == full.seq // 4 and part.context == full.seq and part.params_total == full.params_total
    assert part.flops_per_block == pytest.approx(full.flops_per_block / 4)
    assert part.act_bytes_per_block == pytest.approx(full.act_bytes_per_block / 4)
    # the same as the closed form of a quarter of the sequence attending to all of it
    direct = transformer_stats(LONG, gated_mlp=True, seq=full.seq // 4, context=full.seq)
    assert part.attn_flops_per_block == pytest.approx(direct.attn_flops_per_block)


def test_cp_divides_activations_and_pays_the_kv_all_gather() -> None:
    stats, cluster = transformer_stats(LONG, gated_mlp=True), resolve("h100", devices=8)
    one = estimate(stats, cluster, Plan(dp=8, precision="bf16", recompute="full"), global_batch=8)
    cp = estimate(stats, cluster, Plan(dp=4, cp=2, precision="bf16", recompute="full"), global_batch=4)
    assert cp.memory["activations"] == pytest.approx(one.memory["activations"] / 2, rel=0.05)
    assert cp.detail["cp_comm"] > 0 and one.detail["cp_comm"] == 0


def test_a_sequence_that_fits_only_with_cp_gets_cp() -> None:
    stats, cluster = transformer_stats(LONG, gated_mlp=True), resolve("h100", devices=16)
    # without the runtime options (the chunked loss alone fits tp=8 here), the loss vocabulary-parallel
    plain = SearchOptions(runtime_options=(), run=RunPolicy(loss_parallel=True))
    without = search(stats, cluster, global_batch=2, options=replace(plain, fixed={"cp": 1}))
    assert not without.plans  # no layout of 256k-token sequences fits without splitting them
    best = search(stats, cluster, global_batch=2, options=plain).best
    assert best.plan.cp > 1 and best.fits


def test_ep_divides_the_experts_memory_and_pays_all_to_all() -> None:
    stats, cluster = transformer_stats(MOE, gated_mlp=True), resolve("h100", devices=64)
    dense = stats.params_total - stats.blocks * stats.expert_params_per_block
    replicated = estimate(stats, cluster, Plan(dp=64, precision="bf16", recompute="full"), global_batch=256)
    split = estimate(stats, cluster, Plan(dp=64, ep=8, precision="bf16", recompute="full"), global_batch=256)
    per_param = replicated.model_state_bytes / stats.params_total
    assert split.model_state_bytes == pytest.approx(
        per_param * (dense + stats.blocks * stats.expert_params_per_block / 8)
    )
    assert split.detail["ep_comm"] > 0 == replicated.detail["ep_comm"]
    # Under ZeRO-3 the experts are sharded either way; ep gathers them over 8x fewer ranks.
    one = estimate(stats, cluster, Plan(dp=8, shard=8, zero=3, precision="bf16", recompute="full"), global_batch=256)
    ep = estimate(
        stats, cluster, Plan(dp=8, shard=8, zero=3, ep=8, precision="bf16", recompute="full"), global_batch=256
    )
    assert ep.model_state_bytes == pytest.approx(one.model_state_bytes) and ep.detail["dp_comm"] < one.detail["dp_comm"]


def test_the_search_picks_ep_for_a_large_moe() -> None:
    best = search(transformer_stats(MOE, gated_mlp=True), resolve("h100", devices=64), global_batch=256).best
    assert best.plan.ep > 1


def test_plan_cli_reads_moe_and_long_sequence_specs(capsys: pytest.CaptureFixture) -> None:
    spec = {
        "layers": 32,
        "hidden": 4096,
        "heads": 32,
        "kv_heads": 8,
        "vocab": 32000,
        "seq": 4096,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 14336,
        "learned_positions": False,
        "bias": False,
        "gated_mlp": True,
    }
    assert main(["plan", "--model-spec", json.dumps(spec), "--devices", "64", "--global-batch", "256", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plans"][0]["ep"] > 1
    spec = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "vocab": 32000, "seq": 262144, "ffn": 14336,
            "learned_positions": False, "bias": False, "gated_mlp": True}
    # without the runtime options (with them the chunked loss alone fits tp=8 at this length)
    assert main(["plan", "--model-spec", json.dumps(spec), "--devices", "16", "--global-batch", "2", "--top", "3",
                 "--fixed", "params16=false,chunked_loss=false"]) == 0
    text = capsys.readouterr().out
    assert " cp " in text.splitlines()[1]  # the cp column appears when a plan uses it
