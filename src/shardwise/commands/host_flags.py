"""The ``--hostfile``/``--hosts`` flags that ``shardwise run`` and ``shardwise doctor`` share (not a
command: a helper both command modules import)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.launch.multihost import HostLaunch


def add_host_flags(parser: argparse.ArgumentParser) -> None:
    """Starting every node from this machine over ssh (also used by ``shardwise doctor``)."""
    g = parser.add_argument_group("hosts (start every node from here over ssh; see docs/multinode.md)")
    g.add_argument("--hostfile", default=None, metavar="FILE", help="one host per line: 'node1 slots=8' (# comments)")
    g.add_argument("--hosts", default=None, metavar="H:N,...", help="hosts and processes, e.g. node1:8,node2:8")
    g.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="also forward this variable (NCCL_*, GLOO_*, SHARDWISE_* and PYTHONPATH always are); repeatable",
    )
    g.add_argument("--chdir", default=None, metavar="DIR", help="working directory on every host (default: this one)")
    g.add_argument(
        "--python", default=None, metavar="PATH", help="interpreter on every host (default: this one's path)"
    )
    g.add_argument(
        "--ssh-config", default=None, metavar="FILE", help="ssh configuration file (ssh -F; default: your own)"
    )
    g.add_argument(
        "--ssh-option", action="append", default=[], metavar="KEY=VALUE", help="ssh -o KEY=VALUE; repeatable"
    )
    g.add_argument("--ssh-timeout", type=int, default=10, metavar="SECONDS",
                   help="an unreachable host fails after this long (ssh ConnectTimeout, default %(default)s)")


def host_launch_from_args(args: argparse.Namespace, hang_timeout_s: float | None = None) -> HostLaunch:
    """The ``--hostfile``/``--hosts`` flags as a :class:`~shardwise.launch.multihost.HostLaunch`."""
    from shardwise.launch.hosts import hosts_from
    from shardwise.launch.multihost import HostLaunch
    from shardwise.launch.ssh import SshOptions

    ssh = SshOptions(config_file=args.ssh_config, options=tuple(args.ssh_option), connect_timeout_s=args.ssh_timeout)
    return HostLaunch(hosts=hosts_from(args.hostfile, args.hosts), ssh=ssh, env_names=tuple(args.env), chdir=args.chdir,
                      python=args.python, hang_timeout_s=hang_timeout_s, rdzv_store=getattr(args, "rdzv_store", None))
