"""Async vs synchronous checkpoint saves: how long training is blocked, and how much slower the
steps that overlap an async save are.

One process, an MLP and AdamW (model + two moments are saved). In each repeat, interleaved:
baseline steps without saving; a synchronous save (the whole save blocks); an async save (only
staging the CPU copy blocks) followed by steps until its files are written and committed. Medians
over the repeats; ratios against the baseline measured in the same run.

    python bench/checkpoint_async.py [--width 2048] [--repeats 5] [--out bench/results/checkpoint_async.json]

Targets (the issue): step time during an async save within 1.2x of a step without saving;
blocked time async / sync reported as a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings

import torch
from torch import nn

from shardwise.checkpoint import CheckpointManager


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 16))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline-steps", type=int, default=10)
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "checkpoint_async.json")
    )
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    model = _model(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 16)
    components = {"model": model, "optimizer": optimizer}

    def step() -> float:
        start = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    for _ in range(3):
        step()  # warm-up (and optimizer state exists before the first save)
    base_steps, overlap_steps, sync_s, async_blocked_s, async_total_s, overlapped = [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        sync_mgr = CheckpointManager(os.path.join(tmp, "sync"), keep_last_n=1)
        async_mgr = CheckpointManager(os.path.join(tmp, "async"), keep_last_n=1, async_save=True)
        for r in range(args.repeats):
            base_steps.append(statistics.median(step() for _ in range(args.baseline_steps)))
            start = time.perf_counter()
            sync_mgr.save(components, step=r + 1)
            sync_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            async_mgr.save(components, step=r + 1)
            async_blocked_s.append(time.perf_counter() - start)
            during = []
            while async_mgr.in_flight():
                during.append(step())
            async_mgr.wait()
            async_total_s.append(time.perf_counter() - start)
            overlapped.append(len(during))
            if during:
                overlap_steps.append(statistics.median(during))
    size_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 2**20
    result = {
        "benchmark": "checkpoint_async",
        "model_state_mb": round(size_mb, 1),
        "repeats": args.repeats,
        "step_s_baseline": statistics.median(base_steps),
        "step_s_during_async_save": statistics.median(overlap_steps) if overlap_steps else None,
        "step_ratio_during_async_save": (statistics.median(overlap_steps) / statistics.median(base_steps))
        if overlap_steps
        else None,
        "steps_overlapping_a_save_median": statistics.median(overlapped),
        "sync_save_blocked_s": statistics.median(sync_s),
        "async_save_blocked_s": statistics.median(async_blocked_s),
        "async_save_total_s": statistics.median(async_total_s),
        "blocked_ratio_async_over_sync": statistics.median(async_blocked_s) / statistics.median(sync_s),
        "target_step_ratio": 1.2,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "note": "shared 2-core CPU machine: the writer thread competes with the training step for the same cores",
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
