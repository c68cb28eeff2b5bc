"""Measure the pipeline bubble: the idle fraction of each stage, against (p - 1) / (m + p - 1).

Each stage is a *sleep-bound* module: forward sleeps ``t_f``, backward ``2 t_f`` (the usual
backward/forward cost ratio), around a tiny Linear so that real activations and gradients flow
through ``torch.distributed.pipelining``'s point-to-point sends. Sleeping instead of computing
keeps the measurement honest on a machine with fewer cores than ranks: a stage's compute time does
not depend on what the other ranks do, so only the schedule (and the communication latency) decides
the idle time.

For each pipeline degree p in {2, 4}, schedule (GPipe for m = 1..8; 1F1B for m >= p; interleaved
1F1B with v = 2 virtual stages, each half as long, for the m it supports) and microbatch count m,
we time each rank's compute intervals over one step after a warm-up step, and take

    span    = last compute end on any rank - first compute start on any rank
    idle_r  = 1 - (busy time of rank r) / span

The median over repeats is reported per rank, with the theory ``(p - 1) / (m + p - 1)`` (GPipe,
1F1B) or ``(p - 1) / (v m + p - 1)`` (interleaved). Writes bench/results/pipeline_bubble.json and
bench/results/pipeline_bubble.png (schedules as Gantt charts, measured vs theoretical bubble).

Run:  .venv/bin/python bench/pipeline_bubble.py [--tf-ms 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float, events: list) -> torch.Tensor:
        ctx.seconds, ctx.events = seconds, events
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = time.perf_counter()
        time.sleep(ctx.seconds)
        ctx.events.append(("B", start, time.perf_counter()))
        return grad, None, None


class SleepStage(nn.Module):
    """Forward sleeps ``tf`` seconds, backward ``2 tf``; records (kind, start, end) in ``events``."""

    def __init__(self, tf: float) -> None:
        super().__init__()
        self.tf = tf
        self.lin = nn.Linear(8, 8)
        self.events: list[tuple[str, float, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        time.sleep(self.tf)
        y = self.lin(x)
        self.events.append(("F", start, time.perf_counter()))
        return _SleepBackward.apply(y, 2 * self.tf, self.events)


def theory(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


def measure(schedule: str, m: int, v: int, tf: float, repeats: int) -> dict:
    """Run on every rank of the pool; returns this rank's idle fractions and one step's events."""
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize
    from shardwise.layout import Plan

    p = dist.get_world_size()
    plan = Plan(pp=p, schedule=schedule, microbatches=m, virtual_stages=v)
    meshes = build_mesh(plan, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(*[SleepStage(tf / v) for _ in range(p * v)])
    pm = parallelize(model, plan, meshes, loss_fn=lambda out, y: (out - y).pow(2).mean())
    stages = [
        s
        for stage in (pm.module if isinstance(pm.module, nn.ModuleList) else [pm.module])
        for s in stage.modules()
        if isinstance(s, SleepStage)
    ]
    x, y = torch.randn(8 * m, 8), torch.randn(8 * m, 8)
    pm.pipeline.step(x, y)  # warm-up: shape inference and communicator set-up
    idles, spans, events = [], [], []
    for _ in range(repeats):
        for s in stages:
            s.events.clear()
        dist.barrier()
        pm.pipeline.step(x, y)
        mine = sorted(
            ((kind, a, b, s_index) for s_index, s in enumerate(stages) for kind, a, b in s.events), key=lambda e: e[1]
        )
        bounds = torch.tensor([-mine[0][1], mine[-1][2]], dtype=torch.float64)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)  # earliest start (negated) and latest end
        span = float(bounds[1] + bounds[0])
        busy = sum(b - a for _, a, b, _ in mine)
        idles.append(1.0 - busy / span)
        spans.append(span)
        events = [
            (kind, a + float(bounds[0]), b + float(bounds[0]), k) for kind, a, b, k in mine
        ]  # relative to the start
    return {"idle": statistics.median(idles), "span_s": statistics.median(spans), "events": events}


def configs(p: int) -> list[tuple[str, int, int]]:
    out = [("gpipe", m, 1) for m in range(1, 9)]
    out += [("1f1b", m, 1) for m in range(p, 9)]
    # interleaved 1F1B needs m divisible by its number of rounds max(1, m // p)
    out += [("interleaved_1f1b", m, 2) for m in range(p, 9) if m % max(1, m // p) == 0]
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(14, 9))
    grid = fig.add_gridspec(3, 2, width_ratios=[1.4, 1])
    big = max(results["runs"], key=int)  # the schedules of the deepest pipeline measured
    gantt = [(big, "gpipe", 4, 1), (big, "1f1b", 4, 1), (big, "interleaved_1f1b", 4, 2)]
    colors = plt.get_cmap("tab10")
    for row, (p, schedule, m, v) in enumerate(gantt):
        ax = fig.add_subplot(grid[row, 0])
        entry = next((r for r in results["runs"][p] if r["schedule"] == schedule and r["m"] == m), None)
        if entry is None:
            continue
        for rank, events in enumerate(entry["events"]):
            counters: dict[tuple[str, int], int] = {}
            for kind, a, b, local_stage in events:
                mb = counters.get((kind, local_stage), 0)
                counters[(kind, local_stage)] = mb + 1
                ax.barh(rank, (b - a) * 1e3, left=a * 1e3, color=colors(mb % 10), alpha=1.0 if kind == "F" else 0.55,
                        edgecolor="black", hatch="" if local_stage == 0 else "//", linewidth=0.5)
                ax.text((a + b) / 2 * 1e3, rank, f"{kind}{mb}", ha="center", va="center", fontsize=6)
        ax.set_yticks(range(int(p)), [f"rank {r}" for r in range(int(p))])
        ax.invert_yaxis()
        ax.set_title(f"{schedule}, p={p}, m={m}" + (f", v={v} (hatched: 2nd virtual stage)" if v > 1 else "")
                     + f": idle {entry['mean_idle']:.0%} (theory {entry['theory']:.0%})", fontsize=9)
        ax.set_xlabel("ms (F = forward, pale B = backward; colour = microbatch)", fontsize=8)
    for row, p in enumerate(sorted(results["runs"], key=int)[:2]):
        ax = fig.add_subplot(grid[row, 1])
        for schedule, marker in (("gpipe", "o"), ("1f1b", "s"), ("interleaved_1f1b", "^")):
            runs = [r for r in results["runs"][p] if r["schedule"] == schedule]
            if runs:
                ax.plot(
                    [r["m"] for r in runs],
                    [r["mean_idle"] for r in runs],
                    marker=marker,
                    linestyle="",
                    label=f"{schedule} measured",
                )
        ms = list(range(1, 9))
        ax.plot(ms, [theory(int(p), m) for m in ms], "k-", label="(p-1)/(m+p-1)")
        ax.plot(ms, [theory(int(p), m, 2) for m in ms], "k:", label="(p-1)/(2m+p-1)")
        ax.set_title(f"bubble (idle fraction), p={p}", fontsize=9)
        ax.set_xlabel("microbatches m")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    ax = fig.add_subplot(grid[2, 1])
    ax.axis("off")
    ax.text(0, 0.5, f"sleep-bound stages: forward {results['tf_ms']:.0f} ms, backward {2 * results['tf_ms']:.0f} ms\n"
            f"median of {results['repeats']} steps after a warm-up; Gloo on CPU\n"
            f"max |measured - theory| (gpipe, 1f1b): {results['max_abs_error']:.3f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description="pipeline bubble benchmark")
    parser.add_argument("--tf-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--degrees", default="2,4")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))  # `bench.` importable in the workers
    from shardwise.testing import WorkerPool

    from bench.pipeline_bubble import measure as remote_measure  # by module path, for pickling

    results: dict[str, Any] = {"tf_ms": args.tf_ms, "repeats": args.repeats, "runs": {}}
    for p in (int(d) for d in args.degrees.split(",")):
        pool = WorkerPool(p, timeout_s=300)
        runs = []
        try:
            for schedule, m, v in configs(p):
                per_rank = pool.run(remote_measure, schedule, m, v, args.tf_ms / 1e3, args.repeats)
                idle = [r["idle"] for r in per_rank]
                entry = {
                    "schedule": schedule, "p": p, "m": m, "v": v,
                    "idle_per_stage": idle, "mean_idle": statistics.mean(idle), "theory": theory(p, m, v),
                    "span_ms": per_rank[0]["span_s"] * 1e3, "ideal_span_ms": (v * m + p - 1) * 3 * args.tf_ms / v,
                    "events": [r["events"] for r in per_rank],
                }
                runs.append(entry)
                print(
                    f"p={p} {schedule:17s} m={m} v={v}: idle per stage {', '.join(f'{i:.3f}' for i in idle)}"
                    f"  mean {entry['mean_idle']:.3f}  theory {entry['theory']:.3f}  span {entry['span_ms']:.0f} ms "
                    f"(ideal {entry['ideal_span_ms']:.0f})",
                    flush=True,
                )
        finally:
            pool.close()
        results["runs"][str(p)] = runs
    errors = [abs(r["mean_idle"] - r["theory"]) for runs in results["runs"].values() for r in runs if r["v"] == 1]
    results["max_abs_error"] = max(errors)
    os.makedirs(RESULTS, exist_ok=True)
    slim = {
        **results,
        "runs": {
            p: [{k: v for k, v in r.items() if k != "events" or (r["m"] == 4)} for r in runs]
            for p, runs in results["runs"].items()
        },
    }
    with open(os.path.join(RESULTS, "pipeline_bubble.json"), "w") as fh:
        json.dump(slim, fh, indent=1)
    plot(results, os.path.join(RESULTS, "pipeline_bubble.png"))
    print(f"max |measured - theory| over GPipe/1F1B runs: {results['max_abs_error']:.3f}")
    print(f"wrote {RESULTS}/pipeline_bubble.json and .png")


if __name__ == "__main__":
    main()
