"""The pipeline-schedule chart from a real torch pipelining run (2 Gloo processes, 2 stages, 4
microbatches): the recorded events must show the schedule's order — GPipe runs every forward before
any backward; 1F1B starts backward on the last stage right after its first forward, and stage 0
interleaves — and a microbatch reaches stage 1 only after stage 0 finished it."""

from __future__ import annotations

import pytest

from shardwise.observe.pipeline_trace import PipelineRecorder
from shardwise.observe.plots import bubble_fraction, plot_pipeline_schedule
from shardwise.parallel.mesh import build_mesh
from shardwise.parallel.parallelize import parallelize
from shardwise.layout import Plan
from tests.distributed.test_pipeline import make_workload


def _record(schedule: str, png: str):
    plan = Plan.parse(f"pp=2,schedule={schedule},microbatches=4")
    meshes = build_mesh(plan, "cpu")
    model, batch, loss_fn = make_workload("mlp")
    pm = parallelize(model, plan, meshes, loss_fn=loss_fn)
    rec = PipelineRecorder({s.stage_index: s.submod for s in pm.pipeline.stages}, group=meshes.pp.get_group()).attach()
    for step in range(2):  # the first step also runs the schedule's shape inference
        rec.align()
        pm.pipeline.step(*batch(step))
    rec.detach()
    events = rec.gather()
    if meshes.pp.get_local_rank() == 0:
        plot_pipeline_schedule(events, png, title=f"{schedule}, 2 stages, 4 microbatches")
    return events


def _order(events, stage):
    return [f"{e.kind}{e.microbatch}" for e in sorted((e for e in events if e.stage == stage), key=lambda e: e.start)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_chart_shows_the_schedule(dist2, tmp_path, schedule) -> None:
    png = str(tmp_path / f"{schedule}.png")
    events = dist2.run(_record, schedule, png)[0]
    assert len(events) == 16  # 2 stages x 4 microbatches x (F, B)
    if schedule == "gpipe":
        assert _order(events, 0) == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
        assert _order(events, 1) == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    else:
        assert _order(events, 1) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
        assert _order(events, 0)[:2] == ["F0", "F1"] and _order(events, 0).index("B0") < _order(events, 0).index("F3")
    by = {(e.stage, e.microbatch, e.kind): e for e in events}
    for mb in range(4):
        assert by[(1, mb, "F")].start >= by[(0, mb, "F")].end  # data dependency across stages
        assert by[(0, mb, "B")].start >= by[(1, mb, "B")].start
    assert 0.0 < bubble_fraction(events) < 1.0
    with open(png, "rb") as f:
        assert f.read(4) == b"\x89PNG"
