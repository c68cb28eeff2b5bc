"""Layouts on one 2-D mesh against one process (fp32, 20 steps, rtol 1e-5 as in test_fsdp/test_tp):
DP2 x TP2, FSDP2 x TP2 (2-D DTensor parameters), activation recompute under them, and models
built on the meta device, parallelized, then materialized shard by shard."""

from __future__ import annotations

from shardwise.parallel.parity import GPTWorkload, Run, Training, parity_worker
from tests.distributed.test_tp import LargeModelWorkload

RTOL = 1e-5
TRAINING = Training(steps=20, global_batch=8)


def _check(per_rank):
    for reports in per_rank:
        for report in reports:
            assert report.passed(RTOL), report.format(RTOL)


def test_dp_tp_and_fsdp_tp_on_4(dist4):
    runs = [
        Run("dp=2,tp=2"),
        Run("zero=3,shard=2,tp=2"),
        Run("zero=2,shard=2,tp=2,sp,recompute=selective"),
        # GPT.init_weights writes each DTensor shard from the full values
        Run("zero=3,shard=2,tp=2,recompute=full", meta_init=True),
    ]
    per_rank = dist4.run(parity_worker, GPTWorkload(), runs, TRAINING)
    _check(per_rank)
    fsdp_tp = per_rank[0][1].memory
    assert fsdp_tp["param"] < 0.3 * fsdp_tp["ref_param"], fsdp_tp  # split over 2 x 2, minus replicated norms


def test_meta_init_replays_reset_parameters_on_4(dist4):
    """LargeModel has no init_weights: materialize replays each layer's reset_parameters from the
    seed on a full-size stand-in and keeps the local shard; the result must equal plain construction."""
    runs = [Run("zero=3,shard=4", meta_init=True), Run("zero=3,shard=2,tp=2", meta_init=True), Run("dp=4", meta_init=True)]
    _check(dist4.run(parity_worker, LargeModelWorkload(tp=2), runs, TRAINING))
