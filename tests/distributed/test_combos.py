"""Layouts on one 2-D mesh against one process (fp32, 4 steps, rtol 1e-5 as in test_fsdp/test_tp):
DP2 x TP2, FSDP2 x TP2 (2-D DTensor parameters), activation recompute under them, and models
built on the meta device, parallelized, then materialized shard by shard."""

from __future__ import annotations

from shardwise.verify.parity import GPTWorkload, Run, Training, parity_worker
from tests.distributed.test_tp import LargeModelWorkload

RTOL = 1e-5
TRAINING = Training(
    steps=4, global_batch=8
)  # same rtol as at 20 steps; steps 2-4 use the momentum buffers (sharded, where the layout shards them)


def _check(per_rank):
    for reports in per_rank:
        for report in reports:
            assert report.passed(RTOL), report.format(RTOL)


def test_dp_tp_and_fsdp_tp_on_4(dist4):
    runs = [
        Run("dp=2,tp=2"),
        Run("dp=2,tp=2", accumulation=2),  # replicate()'s all-reduce waits for the boundary micro-step
        Run("zero=3,shard=2,tp=2"),
        Run("zero=2,shard=2,tp=2,sp,recompute=selective"),
        # GPT.init_weights writes each DTensor shard from the full values
        Run("zero=3,shard=2,tp=2,recompute=full", meta_init=True),
    ]
    per_rank = dist4.run(parity_worker, GPTWorkload(), runs, TRAINING)
    _check(per_rank)
    fsdp_tp = per_rank[0][2].memory
    assert fsdp_tp["param"] < 0.3 * fsdp_tp["ref_param"], fsdp_tp  # split over 2 x 2, minus replicated norms


def test_meta_init_replays_reset_parameters_on_4(dist4):
    """LargeModel has no init_weights: materialize replays each layer's reset_parameters from the
    seed on a full-size stand-in and keeps the local shard; the result must equal plain construction."""
    runs = [
        Run("zero=3,shard=4", meta_init=True),
        Run("zero=3,shard=2,tp=2", meta_init=True),
        Run("dp=4", meta_init=True),
    ]
    _check(dist4.run(parity_worker, LargeModelWorkload(tp=2), runs, TRAINING))


def clip_norm_worker(plans: list[str]) -> list[tuple[str, float, float]]:
    """One backward under each plan; the trainer's clipping norm next to DTensor's own."""
    import torch.nn.functional as F

    from shardwise.verify.grad_norm import reference_grad_norm
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize
    from shardwise.layout import Plan
    from shardwise.train.clip import global_grad_norm

    workload = GPTWorkload()
    x, y = workload.batch(0, 8)
    out = []
    for text in plans:
        plan = Plan.parse(text)
        meshes = build_mesh(plan, "cpu")
        pm = parallelize(workload.build(0), plan, meshes)
        dp_rank, dp_size = meshes.dp.get_local_rank(), meshes.dp.size()
        logits = pm.module(x.chunk(dp_size)[dp_rank])
        F.cross_entropy(logits.flatten(0, 1), y.chunk(dp_size)[dp_rank].flatten()).backward()
        params = list(pm.parameters())
        out.append((text, float(global_grad_norm(params)), float(reference_grad_norm(params))))
    return out


def test_trainer_clip_norm_under_tp_and_fsdp(dist4):
    """shardwise.train.clip.global_grad_norm must equal the norm DTensor computes itself, including
    for FSDP x TP, whose parameters are _StridedShard over dp_shard (not a Shard subclass)."""
    for rows in dist4.run(clip_norm_worker, ["zero=3,shard=4", "dp=2,tp=2", "zero=3,shard=2,tp=2"]):
        for plan, clip_norm, reference in rows:
            assert abs(clip_norm - reference) <= 1e-5 * reference, (plan, clip_norm, reference)
