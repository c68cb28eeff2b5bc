"""``shardwise doctor``: check the install, the environment and the collectives."""

from __future__ import annotations

import argparse
import math
import os

from shardwise.commands.host_flags import add_host_flags, host_launch_from_args
from shardwise.config import check_output_file
from shardwise.errors import ShardwiseError

EXAMPLES = """examples:
  shardwise doctor                 environment report and a 2-process collective test
  shardwise doctor --nproc 4 --max-size-mb 64
  shardwise doctor --nproc 0       environment report only
  shardwise doctor --hostfile hosts.txt     pre-flight of every host over ssh, then collectives across them
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check versions, devices, environment and collectives", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local processes for the collective test (default: GPUs, else 2; 0 skips it)",
    )
    p.add_argument("--max-size-mb", type=float, default=None, help="largest message in the bandwidth table")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions per size (the median is reported)")
    p.add_argument(
        "--plot", default=None, metavar="PNG", help="also draw the bandwidth table as a plot into this PNG file"
    )
    add_host_flags(p)
    p.set_defaults(func=_main)


def _check_args(args: argparse.Namespace) -> None:
    """Every flag is checked before the report is printed and before any process starts."""
    if args.nproc is not None and args.nproc < 0:
        raise ShardwiseError(f"--nproc {args.nproc} is negative", hint="use 0 to skip the collective test")
    if args.iters < 1:
        raise ShardwiseError(f"--iters {args.iters} must be a positive integer", hint="e.g. --iters 10")
    if args.max_size_mb is not None and not (math.isfinite(args.max_size_mb) and args.max_size_mb > 0):
        raise ShardwiseError(
            f"--max-size-mb {args.max_size_mb:g} must be a positive number", hint="e.g. --max-size-mb 64"
        )
    if args.plot:
        check_output_file(args.plot, option="--plot")
        from shardwise.observe.plots import check_plot_format

        check_plot_format(args.plot, option="--plot")


def _main(args: argparse.Namespace) -> int:
    _check_args(args)
    if args.hostfile or args.hosts:  # every host over ssh: pre-flight, then collectives across them
        from shardwise.launch.multihost import doctor_on_hosts

        return doctor_on_hosts(
            host_launch_from_args(args), nproc=args.nproc, max_size_mb=args.max_size_mb, iters=args.iters
        )
    import torch

    from shardwise.launch.inprocess import launch
    from shardwise.observe.collectives import format_table
    from shardwise.observe.doctor import collective_worker, default_sizes, version_mismatches
    from shardwise.observe.environment import collect, format_report

    report = collect(os.environ)
    print(format_report(report))
    nproc = args.nproc if args.nproc is not None else (torch.cuda.device_count() or 2)
    if nproc == 0:
        return 0
    sizes = default_sizes(torch.cuda.is_available())
    if args.max_size_mb is not None:
        sizes = [s for s in sizes if s <= args.max_size_mb * 2**20] or sizes[:1]
    print(f"\ncollectives on {nproc} local processes:")
    result = launch(collective_worker, nprocs=nproc, args=(sizes, args.iters), timeout_s=120)[0]
    mismatches = version_mismatches(result.versions)
    if result.versions and not mismatches:
        v = result.versions[0]
        print(
            f"  {'versions':<15} ok: torch {v.torch}, shardwise {v.shardwise}, python {v.python} on all "
            f"{len(result.versions)} ranks"
        )
    for line in mismatches:
        print(f"  {'versions':<15} MISMATCH: {line}")
    failed = [c for c in result.checks if not c.ok]
    for check in result.checks:
        print(f"  {check.op:<15} {'ok' if check.ok else 'FAILED: ' + check.detail}")
    if failed:
        raise ShardwiseError(f"{len(failed)} collective(s) returned wrong values: {', '.join(c.op for c in failed)}",
                             hint="check the network interface variables above and the driver versions")
    print(f"\nbandwidth ({result.backend}, {result.world_size} processes; busbw as nccl-tests define it):")
    print(format_table(result.bandwidth))
    if args.plot:
        from shardwise.observe.plots import plot_bandwidth

        print(
            "bandwidth plot: "
            f"{plot_bandwidth(result.bandwidth, args.plot, title=f'{result.backend}, {result.world_size} processes')}"
        )
    if mismatches:
        raise ShardwiseError(
            "ranks run different versions: " + "; ".join(mismatches),
            hint="install the same torch and shardwise on every node (one container image or environment)",
        )
    print("\nall checks passed")
    return 0
