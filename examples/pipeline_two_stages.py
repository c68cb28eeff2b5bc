"""The reference guides' pipeline example: two stages, 4 microbatches.

MindSpore writes it as ``PipelineCell(SequentialCell([stage1, stage2]), 4)``; in shardwise the
stages are wrapped in :class:`shardwise.PipelineStages` and the plan says
``pp=2,microbatches=4``. Stage 1 runs on rank 0, stage 2 on rank 1; each step pushes 4
microbatches through the schedule (1F1B by default, ``--schedule gpipe`` for GPipe), the loss is
computed on stage 2 and reported on both ranks.

Run (either form)::

    shardwise run --nproc-per-node 2 examples/pipeline_two_stages.py
    python examples/pipeline_two_stages.py            # starts its own 2 processes

The guide's widths are 1024/2048; ``--width 256`` (default) keeps the CPU run short, ``--width 1024``
is the guide's size. At the end rank 0 trains the unsplit model on the same batches and prints
the largest loss difference, which is float32 rounding (the pipeline is exact).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.parallel.mesh import build_mesh
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.pipeline.split import stage_summary, split_model
from shardwise.layout import Plan


class Stage1(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, 2 * width), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Stage2(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2 * width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def batches(width: int, steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable regression task: y = relu(x W) for a fixed random W."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(width, width, generator=g) / width**0.5
    out = []
    for _ in range(steps):
        x = torch.randn(batch, width, generator=g)
        out.append((x, torch.relu(x @ w)))
    return out


def main(args: argparse.Namespace) -> list[float]:
    env = shardwise.init()
    torch.manual_seed(0)
    net = shardwise.PipelineStages(Stage1(args.width), Stage2(args.width))  # = SequentialCell([stage1, stage2])
    reference = copy.deepcopy(net)
    plan = Plan.parse(f"pp=2,microbatches={args.microbatches},schedule={args.schedule}")
    if env.rank == 0:
        print(plan.describe())
        print("\n".join(stage_summary(split_model(copy.deepcopy(net), 2))))
    meshes = build_mesh(plan, env.device.type)
    pm = parallelize(net, plan, meshes, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(pm.parameters(), lr=args.lr, momentum=0.9)
    data = batches(args.width, args.steps, args.batch)
    losses = []
    for step, (x, y) in enumerate(data):
        loss = pm.pipeline.step(x, y)  # 4 microbatches forward and backward; the loss on every rank
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if env.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.6f}")
    if env.rank == 0:  # the same training in one process, for comparison
        ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr, momentum=0.9)
        worst = 0.0
        for (x, y), got in zip(data, losses):
            ref_loss = F.mse_loss(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            worst = max(worst, abs(got - ref_loss.item()) / abs(ref_loss.item()))
        print(f"largest relative loss difference vs one process over {args.steps} steps: {worst:.2e}")
    return losses


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if "RANK" in os.environ:  # started by shardwise run / torchrun
        main(arguments)
        shardwise.shutdown()
    else:
        shardwise.launch(main, nprocs=2, args=(arguments,))
