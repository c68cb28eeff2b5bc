"""``shardwise lighthouse``: host torchft's quorum server for fault-tolerant replica groups on a
machine every group reaches (beside ``shardwise rendezvous``; see docs/multinode.md)."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  shardwise lighthouse --port 29510 --min-replicas 1
  # then on each training machine (here group 1 of 2):
  shardwise run --ft-replicas 2 --ft-replica-id 1 --lighthouse login1:29510 --nproc-per-node 8 --max-restarts 3 train.py
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lighthouse", help="host torchft's quorum server for fault-tolerant replica groups",
                       description="Serve torchft's lighthouse until stopped: the replica groups of 'shardwise run "
                                   "--ft-replica-id' meet there at every step.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=29510, help="the port to listen on, every address (default %(default)s)")
    p.add_argument("--min-replicas", type=int, default=1, help="fewest groups that form a quorum (default 1)")
    p.add_argument(
        "--heartbeat-timeout", type=float, default=5.0, metavar="S", help="drop a group silent this long (default 5)"
    )
    p.add_argument(
        "--join-timeout", type=float, default=1.0, metavar="S", help="wait this long for more groups (default 1)"
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from shardwise.errors import ConfigError
    from shardwise.launch.ft import FtOptions, serve_lighthouse

    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a port", hint="use 1-65535 (0: any free port), e.g. --port 29510")
    options = FtOptions(replicas=max(1, args.min_replicas), min_replicas=args.min_replicas,
                        heartbeat_timeout_s=args.heartbeat_timeout, join_timeout_s=args.join_timeout)
    options.check()
    return serve_lighthouse(args.port, options)
