"""One process of ``shardwise doctor --hostfile FILE``: the collective checks across every host.

``shardwise doctor --hostfile`` runs pre-flight, then starts this module on every host the way
``shardwise run --hostfile`` starts a script (``python -m shardwise.observe.doctor_world``). Every
rank joins the world, gathers the versions, checks all_reduce, broadcast, all_gather,
reduce_scatter and barrier for correct values and times them by message size; rank 0 prints the
report. The exit code is 1 when a check fails or the ranks run different versions.
"""

from __future__ import annotations

import argparse
import sys

from shardwise.observe.collectives import format_table
from shardwise.observe.doctor import collective_worker, default_sizes, version_mismatches


def report(sizes: list[int], iters: int) -> tuple[str, bool]:
    """Run the checks on this rank; rank 0 gets the report text, every rank whether all passed."""
    import torch.distributed as dist

    result = collective_worker(sizes, iters)
    mismatches = version_mismatches(result.versions)
    lines = []
    hosts = sorted({v.host for v in result.versions})
    if result.versions and not mismatches:
        v = result.versions[0]
        lines.append(f"  {'versions':<15} ok: torch {v.torch}, shardwise {v.shardwise}, python {v.python} on all "
                     f"{len(result.versions)} ranks ({len(hosts)} host(s): {', '.join(hosts)})")
    lines += [f"  {'versions':<15} MISMATCH: {line}" for line in mismatches]
    lines += [f"  {c.op:<15} {'ok' if c.ok else 'FAILED: ' + c.detail}" for c in result.checks]
    passed = all(c.ok for c in result.checks) and not mismatches
    if result.bandwidth:
        lines.append(f"\nbandwidth ({result.backend}, {result.world_size} processes; busbw as nccl-tests define it):")
        lines.append(format_table(result.bandwidth))
    lines.append("\nall checks passed" if passed else "\nsome checks FAILED (see above)")
    return ("\n".join(lines) if dist.get_rank() == 0 else ""), passed


def main(argv: list[str] | None = None) -> int:
    import torch

    from shardwise.runtime.env import init, shutdown

    p = argparse.ArgumentParser(prog="python -m shardwise.observe.doctor_world")
    p.add_argument("--max-size-mb", type=float, default=None)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    env = init()
    sizes = default_sizes(torch.cuda.is_available())
    if args.max_size_mb is not None:
        sizes = [s for s in sizes if s <= args.max_size_mb * 2**20] or sizes[:1]
    if env.is_main:
        print(f"collectives on {env.world_size} processes over {env.num_nodes} node(s):", flush=True)
    text, passed = report(sizes, args.iters)
    if text:
        print(text, flush=True)
    shutdown()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
