"""``shardwise rendezvous``: host the c10d rendezvous store on a machine that does not train, so
that no training node is special (any of them may be lost; see docs/multinode.md)."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  shardwise rendezvous --port 29400            # on a login node, or any machine every node reaches
  # then on each node:
  shardwise run --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint login1:29400 --rdzv-conf is_host=0 \\
      --rdzv-id job7 --max-restarts 3 train.py
  # with --hostfile the launcher hosts it itself (--rdzv-store launcher, the default of an elastic job)
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rendezvous", help="host the rendezvous store on a machine that does not train",
                       description="Serve torch's c10d rendezvous store (a TCPStore) until stopped, so that the "
                                   "training nodes all join as clients and any of them may be lost.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=29400, help="the port to listen on, every address (default %(default)s)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from shardwise.errors import ConfigError
    from shardwise.launch.store import serve_forever

    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a port", hint="use 1-65535 (0: any free port), e.g. --port 29400")
    return serve_forever(args.port)
