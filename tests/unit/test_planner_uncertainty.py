"""Prediction intervals and the validated envelope (shardwise.plan.uncertainty), as the search and
`shardwise plan` use them."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.layout import Plan
from shardwise.plan.cluster import PRESETS
from shardwise.plan.cost import estimate
from shardwise.plan.search import SearchOptions, search
from shardwise.plan.stats import transformer_stats
from shardwise.plan.uncertainty import (
    CARRIED,
    INTERVALS,
    bounded,
    carried_factor,
    envelope_mfu,
    interval,
    interval_key,
    kind_keys,
)
from shardwise.shape import TransformerShape

ROOT = Path(__file__).resolve().parents[2]
GPT13B = TransformerShape(layers=40, hidden=5120, heads=40, vocab_size=51200, seq_len=2048)


def test_the_intervals_are_the_benchmark_s_cross_validated_ones() -> None:
    """The table in the source is what bench/planner_published.py wrote from its leave-one-source-out
    residuals (rerun the benchmark and copy `cv.intervals` after a change of the cost model)."""
    results = json.loads((ROOT / "bench" / "results" / "planner_published.json").read_text())
    assert INTERVALS == results["cv"]["intervals"]
    assert CARRIED == results["cv"]["carried"]
    assert all(band["low"] < 1.0 < band["high"] and band["runs"] >= 8 for band in INTERVALS.values())


def test_an_unmeasured_kind_of_run_falls_back_to_a_wider_pool() -> None:
    h100 = PRESETS["h100"].with_devices(256, 8)
    keys = kind_keys(Plan(dp=8, tp=4, pp=8, microbatches=8), h100)
    assert keys == ["H100/pp/large", "H100/pp", "pp/large", "pp", "all"]
    assert interval_key(keys, {"pp": {}, "all": {}}) == "pp" and interval_key(keys, {"all": {}}) == "all"
    assert interval_key(kind_keys(Plan(dp=4), PRESETS["cpu"].with_devices(4, 2))) in INTERVALS


def test_a_chip_one_source_measured_gets_a_wider_interval() -> None:
    """The H100's figures are carried over from the A100, not cross-validated: its band is its kind's
    widened both ways by the largest factor a held-out H100 prediction was off by; a chip nothing
    published measured borrows the largest such factor; the A100's own kinds are not widened."""
    stats = transformer_stats(GPT13B)
    plan = Plan(shard=64, zero=3, recompute="full")
    a100, h100 = PRESETS["a100-80gb"].with_devices(64, 8), PRESETS["h100"].with_devices(64, 8)
    on_a100, on_h100 = estimate(stats, a100, plan, global_batch=256), estimate(stats, h100, plan, global_batch=256)
    lo_a, _, key_a = interval(on_a100, a100)
    lo_h, hi_h, key_h = interval(on_h100, h100)
    factor = CARRIED["H100"]["factor"]
    assert carried_factor("A100") == 1.0 and factor > 1.0
    assert lo_a / on_a100.tokens_per_s == pytest.approx(INTERVALS[key_a]["low"])
    assert lo_h / on_h100.tokens_per_s == pytest.approx(INTERVALS[key_h]["low"] / factor)
    assert hi_h / on_h100.tokens_per_s == pytest.approx(INTERVALS[key_h]["high"] * factor)
    assert carried_factor("V100") == max(c["factor"] for c in CARRIED.values())
    assert carried_factor("A100", {"all": {}}, {}) == 1.0  # nothing measured, nothing carried: the pooled band alone


def test_the_search_never_predicts_faster_than_the_envelope() -> None:
    """GPT-3 13B on 64 A100s: the cost model alone prices the best plan above the best MFU any
    published A100 run measured (60.4%) plus 5%; the search reports it at the envelope, and says so."""
    stats = transformer_stats(GPT13B)
    cluster = PRESETS["a100-80gb"].with_devices(64, 8)
    cap = envelope_mfu(cluster, "bf16")
    assert cap == pytest.approx(0.604 * 1.05)
    best = search(stats, cluster, global_batch=256, options=SearchOptions(top=3)).plans
    raw = estimate(stats, cluster, best[0].plan, global_batch=256)
    assert raw.mfu > cap and all(e.mfu <= cap + 1e-12 for e in best)
    assert best[0].detail["envelope_s"] == pytest.approx(best[0].step_time_s - raw.step_time_s)
    assert bounded(best[0], cluster) is best[0]  # bounding is idempotent
    assert envelope_mfu(PRESETS["cpu"], "fp32") is None  # nothing published measured a CPU
    low, high, _ = interval(best[0], cluster)
    assert low < best[0].tokens_per_s < high


def _plan(*argv: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", *argv]) == 0
    return buf.getvalue()


def test_the_plan_command_prints_the_interval_and_the_ties_within_it() -> None:
    out = _plan("--model", "gpt3-13b", "--devices", "64", "--device-type", "a100-80gb", "--top", "3")
    line = next(x for x in out.splitlines() if x.startswith("#1 ") and "interval" in x)
    assert "x the prediction: the 90% interval" in line and "each predicted without its source" in line
    assert "#2" in line and "ranked within the model's error" in line
    data = json.loads(_plan("--model", "gpt3-13b", "--devices", "64", "--device-type", "a100-80gb", "--json"))
    low, high = data["plans"][0]["tokens_per_s_interval"]
    assert low < data["plans"][0]["tokens_per_s"] < high and data["plans"][0]["interval_kind"] in INTERVALS


def test_fixed_shows_the_framework_s_figure_beside_shardwise_s() -> None:
    out = _plan("--model", "gpt3-13b", "--devices", "64", "--device-type", "a100-80gb", "--fixed", "tp=8,pp=2")
    line = next(x for x in out.splitlines() if x.startswith("as Megatron-LM / torchtitan / llm-foundry run these keys"))
    assert "--precision-policy 16bit" in line and "x the speed predicted for shardwise" in line
    framework = _plan("--model", "gpt3-13b", "--devices", "64", "--device-type", "a100-80gb", "--fixed", "tp=8,pp=2",
                      "--precision-policy", "16bit")
    assert "as Megatron-LM" not in framework  # already the framework's policy


def test_the_envelope_is_the_benchmark_s_and_a_search_takes_another() -> None:
    """ENVELOPE_MFU is what bench/planner_published.py read off the published runs; a search given
    another table (the cross-validation's, made without a source) is bounded by that one; an FP8
    plan with no measured FP8 gain gets the FP8 peak's prior."""
    from shardwise.plan.uncertainty import ENVELOPE_MARGIN, ENVELOPE_MFU, FP8_PRIOR

    results = json.loads((ROOT / "bench" / "results" / "planner_published.json").read_text())
    assert ENVELOPE_MFU == results["envelope"]
    stats = transformer_stats(GPT13B)
    cluster = PRESETS["a100-80gb"].with_devices(64, 8)
    tight = {"A100": 0.3}
    found = search(stats, cluster, global_batch=256, options=SearchOptions(top=3, envelope=tight)).plans
    assert all(e.mfu <= 0.3 * (1 + ENVELOPE_MARGIN) + 1e-12 for e in found) and found[0].detail["envelope_s"] > 0
    h100 = PRESETS["h100"].with_devices(64, 8)
    assert envelope_mfu(h100, "fp8", {"H100": 0.5}) == pytest.approx(0.5 * (1 + ENVELOPE_MARGIN) * FP8_PRIOR)
    assert envelope_mfu(h100, "bf16", {"A100": 0.5}) is None  # a table without the chip bounds nothing
