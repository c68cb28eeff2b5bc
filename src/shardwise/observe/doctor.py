"""``shardwise doctor``: is this machine ready for distributed training?

1. Report versions, devices, backends and the variables that matter, with warnings for pitfalls.
2. Start N local processes (the same way ``shardwise run`` does), check all_reduce, broadcast,
   all_gather, reduce_scatter and barrier for correct values, and time them by message size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from shardwise.observe.collectives import BandwidthRow, CheckResult, check_values, measure_bandwidth


@dataclass(frozen=True)
class CollectiveReport:
    world_size: int
    backend: str
    checks: list[CheckResult]
    bandwidth: list[BandwidthRow]


def collective_worker(sizes: list[int], iters: int) -> CollectiveReport:
    """Runs on every rank of a launched group; rank 0's report is the one shown."""
    from shardwise.runtime.env import init

    env = init()
    checks = check_values(env.device)
    rows = measure_bandwidth(env.device, sizes, iters=iters) if all(c.ok for c in checks) else []
    return CollectiveReport(dist.get_world_size(), env.backend, checks, rows)


def default_sizes(on_gpu: bool) -> list[int]:
    top = 256 * 2**20 if on_gpu else 16 * 2**20
    sizes, size = [], 4 * 2**10
    while size <= top:
        sizes.append(size)
        size *= 4
    return sizes
