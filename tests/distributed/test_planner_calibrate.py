"""`shardwise calibrate`'s worker on 2 real Gloo processes: the spec it yields is complete and usable."""

from __future__ import annotations

import pytest

from shardwise.calibrate.calibration import calibrate_worker, to_spec
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.search import search
from shardwise.plan.stats import TransformerSpec, transformer_stats


@pytest.mark.timeout(480)
def test_calibration_yields_a_usable_spec(dist2, tmp_path) -> None:
    # Every measurement of a calibration, at the sizes of `shardwise calibrate --quick`: the same code
    # path as the default sizes (calibrate_worker), with the two narrower transformer layers only.
    cals = dist2.run(calibrate_worker, [4 * 2**10, 64 * 2**10, 2**20], [64, 128], 2, timeout_s=420, quick=True)
    cal = cals[0]
    assert cal.world_size == 2 and cal.device_type == "cpu"
    # every rank reports the slowest rank's figures
    assert cals[1].matmul == cal.matmul
    assert all(v > 0 for by_size in cal.matmul.values() for v in by_size.values())
    assert cal.memory_bw > 0 and cal.overhead_s > 0 and cal.memory_bytes > 0
    assert cal.dtensor_overhead_s >= 0 and cal.solo_matmul > 0
    # TP and FSDP over two processes cost more than the plain tiny GPT (collectives, hooks, dispatch)
    # (each figure is a difference of two timings, clipped at 0: on a busy host one can come out 0)
    overheads = [cal.layer_overheads[k] for k in ("tp_layer_s", "zero3_unit_s", "zero2_unit_s", "pp_microbatch_s")]
    assert all(v >= 0 for v in overheads) and sum(overheads[:3]) > 0
    # a real transformer layer reaches less than the matmul figure of a comparable size
    for precision in ("fp32", "bf16"):
        assert all(v > 0 for v in cal.block_flops[precision].values())
        # a table under full recomputation at the same shapes (its rate against the plain table is a
        # measurement, not asserted: within a busy suite it came out either way)
        recompute = cal.block_flops[precision + "+recompute"]
        assert recompute.keys() == cal.block_flops[precision].keys() and all(v > 0 for v in recompute.values())
    assert cal.layer_overheads["pipeline_overlap"] >= 1.0  # 2 stages on this host's cores
    assert cal.optimizer["param_s"] > 0 and cal.optimizer["tensor_s"] > 0
    assert cal.optimizer["dtensor_tensor_s"] > cal.optimizer["tensor_s"]  # DTensor dispatch on every operator
    assert {r.op for r in cal.collectives} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    spec = to_spec(cal, name="test")
    assert spec.devices == 2 and spec.overlap == 0.0 and spec.intra_bw > 0
    assert spec.peak_flops["fp32"] == max(cal.matmul["fp32"].values())
    assert spec.matmul_flops("fp32", 64) == pytest.approx(cal.matmul["fp32"][64])
    assert spec.tp_layer_overhead_s == cal.layer_overheads["tp_layer_s"]
    assert spec.zero3_unit_overhead_s == cal.layer_overheads["zero3_unit_s"]
    assert spec.optimizer_param_s == cal.optimizer["param_s"] and spec.block_flops("fp32", 200.0) > 0
    assert 1.0 <= spec.oversubscription <= 2.0  # 2 processes with one thread each
    spec.save(str(tmp_path / "cluster.json"))
    loaded = ClusterSpec.load(str(tmp_path / "cluster.json"))
    result = search(
        transformer_stats(TransformerSpec(layers=2, hidden=64, heads=4, vocab_size=64, seq_len=16)),
        loaded,
        global_batch=8,
    )
    assert result.best.plan.world_size == 2
