"""Draw the pictures of docs/troubleshooting.md from real runs on local Gloo processes.

1. ``docs/img/timeline_straggler.png``: 4 ranks train an MLP with DDP; rank 2 sleeps 150 ms in its
   forward. Its lane shows a long forward, the others' lanes show the wait as communication.
2. ``docs/img/pipeline_1f1b.png``: a 2-stage 1F1B pipeline with 4 microbatches, measured.

    python bench/observe_pictures.py [--out docs/img]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwise


def straggler_timeline(png: str) -> str | None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    if rank == 2:
        model[0].register_forward_pre_hook(lambda *_: time.sleep(0.15))
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    from shardwise.observe.profiler import StepProfiler
    from shardwise.observe.stragglers import find_stragglers, gather_summaries, summarize

    prof = StepProfiler().attach(model, opt)
    x = torch.randn(64, 64)
    for step in range(1, 9):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        prof.end_step(step)
    prof.detach()
    recs = list(prof.records)[-4:]
    found = find_stragglers(gather_summaries(summarize(recs, rank=rank)))
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, recs)
    if rank == 0:
        from shardwise.observe.plots import plot_timeline

        title = "DDP, 4 ranks; " + ("; ".join(s.describe().split(":")[0] for s in found) or "no straggler")
        return plot_timeline(dict(enumerate(out)), png, title=title)
    return None


def pipeline_chart(png: str) -> str | None:
    from shardwise.observe.pipeline_trace import PipelineRecorder
    from shardwise.observe.plots import plot_pipeline_schedule
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize
    from shardwise.layout import Plan

    plan = Plan.parse("pp=2,schedule=1f1b,microbatches=4")
    meshes = build_mesh(plan, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)], nn.Linear(512, 4))
    pm = parallelize(model, plan, meshes, loss_fn=F.mse_loss)
    rec = PipelineRecorder({s.stage_index: s.submod for s in pm.pipeline.stages}, group=meshes.pp.get_group()).attach()
    x, y = torch.randn(64, 512), torch.randn(64, 4)
    for _ in range(3):
        rec.align()
        pm.pipeline.step(x, y)
    events = rec.gather()
    if dist.get_rank() == 0:
        return plot_pipeline_schedule(events, png, title="1F1B, 2 stages, 4 microbatches (measured)")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img")
    )
    ap.add_argument("--timeline-only", action="store_true")
    args = ap.parse_args()
    print(shardwise.launch(straggler_timeline, nprocs=4, args=(os.path.join(args.out, "timeline_straggler.png"),))[0])
    if not args.timeline_only:
        print(shardwise.launch(pipeline_chart, nprocs=2, args=(os.path.join(args.out, "pipeline_1f1b.png"),))[0])


if __name__ == "__main__":
    main()
