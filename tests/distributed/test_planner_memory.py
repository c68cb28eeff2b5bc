"""Predicted vs measured per-rank model-state bytes (parameters + gradients + Adam state) on 4
Gloo processes, for every layout the parallel layer applies: the cost model must be within 10%."""

from __future__ import annotations

import pytest

from shardwise.plan.cluster import resolve
from shardwise.plan.cost import StatePolicy, estimate
from shardwise.calibrate.measure import measure_plan_worker
from shardwise.layout import Plan
from shardwise.plan.stats import TransformerSpec, transformer_stats

CONFIG = {"vocab_size": 64, "seq_len": 16, "layers": 2, "hidden": 64, "heads": 4}
SPEC = TransformerSpec(layers=2, hidden=64, heads=4, vocab_size=64, seq_len=16, name="gpt")
BATCH = 8


def predicted(plan_text: str) -> dict[str, float]:
    plan = Plan.parse(plan_text)
    est = estimate(
        transformer_stats(SPEC),
        resolve("cpu", devices=4),
        plan,
        global_batch=BATCH,
        policy=StatePolicy.torch("fp32", "adam"),
    )
    return {k: est.memory[k] for k in ("params", "grads", "optimizer")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "plan_text",
    ["dp=4", "zero=1,dp=4", "zero=2,dp=4", "zero=3,dp=4", "tp=4", "zero=3,dp=2,tp=2", "pp=2,dp=2,microbatches=2"],
)
def test_model_state_memory_within_10_percent(dist4, plan_text: str) -> None:
    results = dist4.run(measure_plan_worker, plan_text, CONFIG, global_batch=BATCH, steps=1, warmup=0)
    got = results[0]
    assert "error" not in got, got["error"]
    want = predicted(plan_text)
    total_got, total_want = sum(got["memory"].values()), sum(want.values())
    assert total_got == pytest.approx(total_want, rel=0.10), (got["memory"], want)
    for kind in ("params", "grads", "optimizer"):
        assert got["memory"][kind] == pytest.approx(want[kind], rel=0.10), (kind, got["memory"], want)
