"""``shardwise doctor``: is this machine ready for distributed training?

1. Report versions, devices, backends and the variables that matter, with warnings for pitfalls.
2. Start N local processes (the same way ``shardwise run`` does), check all_reduce, broadcast,
   all_gather, reduce_scatter and barrier for correct values, and time them by message size.
"""

from __future__ import annotations

import platform
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardwise.observe.collectives import BandwidthRow, CheckResult, check_values, measure_bandwidth


@dataclass(frozen=True)
class RankVersions:
    """The versions one rank runs with (mismatches across nodes cause hangs and wrong results)."""

    rank: int
    host: str
    python: str
    torch: str
    shardwise: str
    cuda: str
    nccl: str


def local_versions(rank: int) -> RankVersions:
    from shardwise.version import __version__

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    return RankVersions(rank, socket.gethostname(), platform.python_version(), torch.__version__, __version__,
                        torch.version.cuda or "-", nccl)


def gather_versions() -> list[RankVersions]:
    """Every rank's versions, on every rank (one ``all_gather_object``)."""
    mine = local_versions(dist.get_rank() if dist.is_initialized() else 0)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    out: list[RankVersions | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return [v for v in out if v is not None]


def version_mismatches(rows: list[RankVersions]) -> list[str]:
    """One line per component whose version differs across ranks, saying which ranks run what."""
    lines = []
    for name in ("torch", "shardwise", "python", "cuda", "nccl"):
        by_value: dict[str, list[RankVersions]] = {}
        for r in rows:
            by_value.setdefault(getattr(r, name), []).append(r)
        if len(by_value) > 1:
            parts = [
                f"{value} on rank(s) {_ranks(rs)} ({', '.join(sorted({r.host for r in rs}))})"
                for value, rs in sorted(by_value.items())
            ]
            lines.append(f"{name} differs across ranks: " + "; ".join(parts))
    return lines


def _ranks(rows: list[RankVersions]) -> str:
    ranks = sorted(r.rank for r in rows)
    return ",".join(map(str, ranks)) if len(ranks) < 6 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"


@dataclass(frozen=True)
class CollectiveReport:
    world_size: int
    backend: str
    checks: list[CheckResult]
    bandwidth: list[BandwidthRow]
    versions: list[RankVersions] = field(default_factory=list)


def collective_worker(sizes: list[int], iters: int) -> CollectiveReport:
    """Runs on every rank of a launched group; rank 0's report is the one shown."""
    from shardwise.runtime.env import init

    env = init()
    versions = gather_versions()
    checks = check_values(env.device)
    rows = measure_bandwidth(env.device, sizes, iters=iters) if all(c.ok for c in checks) else []
    return CollectiveReport(dist.get_world_size(), env.backend, checks, rows, versions)


def default_sizes(on_gpu: bool) -> list[int]:
    top = 256 * 2**20 if on_gpu else 16 * 2**20
    sizes, size = [], 4 * 2**10
    while size <= top:
        sizes.append(size)
        size *= 4
    return sizes
