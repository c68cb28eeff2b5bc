"""``shardwise run --hostfile FILE --ft-replicas R``: fault-tolerant replica groups over ssh.

The ``H`` hosts (``H`` divisible by ``R``) split in order into ``R`` groups of ``H/R``: group ``r``
is hosts ``r*H/R .. (r+1)*H/R - 1``. Each group is its own world with its own c10d rendezvous
(run id ``<id>-ft<r>``; the store on this launcher as for any restartable hostfile job, every
group a separate key space of it, or a running ``shardwise rendezvous`` given with
``--rdzv-store HOST:PORT``) and its own ``--max-restarts``; every node runs the ordinary
``shardwise run --ft-replica-id r --lighthouse HOST:PORT`` (:mod:`shardwise.launch.ft`).

torchft's lighthouse runs in this launcher (every address, a free port) unless ``--lighthouse``
names a running one; each host reaches it at the address its ssh session reaches this machine
(pre-flight's ``store_addr``, the same address the rendezvous store uses). A failed host does not
stop the others while at least ``--ft-min-replicas`` groups' worth of hosts are alive (the
survivors keep stepping). The job succeeds when any group finishes; once one has, the others get
``--ft-timeout`` seconds to finish too and are then stopped (a group still restarting would
otherwise train on alone from its last state), as on one machine. With ``--ft-dir`` on a file
system shared with the hosts, the groups' events are summed up in ``<ft dir>/summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import uuid
from dataclasses import dataclass
from typing import Sequence

from shardwise.errors import LaunchError
from shardwise.launch.ft import FtOptions, start_lighthouse, summarize
from shardwise.launch.hosts import Host
from shardwise.launch.multihost import HostLaunch, World, endpoint, node_args, preflight, store_choice
from shardwise.launch.options import RunOptions
from shardwise.launch.sessions import Session, Sessions
from shardwise.launch.ssh import remote_command, ssh_argv


@dataclass(frozen=True)
class GroupNode:
    """One host's part of a fault-tolerant job: its group and its ``shardwise run`` arguments."""

    host: Host
    replica: int
    args: tuple[str, ...]


def split_hosts(hosts: Sequence[Host], replicas: int) -> list[tuple[Host, ...]]:
    """The ``R`` groups of hosts, in hostfile order; refuses a count ``R`` does not divide."""
    if len(hosts) % replicas:
        raise LaunchError(
            f"--ft-replicas {replicas} does not divide the {len(hosts)} hosts listed",
            hint=f"list a multiple of {replicas} hosts (each group gets the same number), or change --ft-replicas",
        )
    size = len(hosts) // replicas
    return [tuple(hosts[r * size:(r + 1) * size]) for r in range(replicas)]


def check_ft_hosts(options: RunOptions, ft: FtOptions, rdzv_store: str | None) -> None:
    """What a fault-tolerant hostfile job refuses, before any host is asked."""
    if ft.replica_id is not None:
        raise LaunchError(
            "--ft-replica-id cannot be combined with --hostfile/--hosts",
            hint="the launcher starts every group; drop --ft-replica-id (or start each group by hand without "
            "--hostfile)",
        )
    for flag, value in (
        ("--nnodes", options.nnodes),
        ("--node-rank", options.node_rank),
        ("--rdzv-endpoint", options.rdzv_endpoint),
        ("--master-addr", options.master_addr),
        ("--master-port", options.master_port),
    ):
        if value is not None:
            raise LaunchError(
                f"{flag} cannot be combined with --hostfile/--hosts --ft-replicas",
                hint="each group's size is hosts/replicas and its rendezvous is set by the launcher; drop " + flag,
            )
    if rdzv_store == "node0":
        raise LaunchError(
            "--rdzv-store node0 cannot be combined with --ft-replicas",
            hint="leave --rdzv-store out (the store lives on this launcher) or give HOST:PORT of 'shardwise "
            "rendezvous'",
        )
    if rdzv_store and not ft.lighthouse and not rdzv_store.startswith("launcher"):
        raise LaunchError(
            f"--rdzv-store {rdzv_store} with a lighthouse on this launcher: the hosts' way back here is unknown",
            hint="also give --lighthouse HOST:PORT of a running 'shardwise lighthouse', or drop --rdzv-store",
        )


def ft_flags(ft: FtOptions, replica: int, lighthouse: str) -> list[str]:
    """The ``--ft-*`` flags of group ``replica``'s nodes (the lighthouse-side ones stay here)."""
    flags = ["--ft-replicas", str(ft.replicas), "--ft-replica-id", str(replica), "--lighthouse", lighthouse,
             "--ft-min-replicas", str(ft.min_replicas), "--ft-timeout", f"{ft.timeout_s:g}",
             "--ft-quorum-timeout", f"{ft.quorum_timeout_s:g}"]
    return flags + (["--ft-dir", ft.ft_dir] if ft.ft_dir else [])


def group_nodes(options: RunOptions, hosts: Sequence[Host], ft: FtOptions, *, store_endpoints: Sequence[str],
                lighthouses: Sequence[str], run_id: str, hang_timeout_s: float | None) -> list[GroupNode]:
    """Every host's ``shardwise run`` arguments: group ``r``'s nodes ranked 0.. within it, one c10d
    rendezvous per group (``<run_id>-ft<r>``), each host with its own store and lighthouse address."""
    c10d = dataclasses.replace(options, rdzv_backend="c10d")
    nodes = []
    offset = 0
    for r, group in enumerate(split_hosts(hosts, ft.replicas)):
        world = World(nnodes=str(len(group)), elastic=False, master_addr="", master_port=0, run_id=f"{run_id}-ft{r}",
                      store_endpoints=tuple(store_endpoints[offset:offset + len(group)]))
        for rank, host in enumerate(group):
            args = node_args(c10d, host, rank, world, hang_timeout_s=hang_timeout_s)
            at = len(args) - len(options.script_args) - 1 - int(options.module)  # before [-m] script args
            nodes.append(GroupNode(host, r, tuple(args[:at] + ft_flags(ft, r, lighthouses[offset + rank]) + args[at:])))
        offset += len(group)
    return nodes


def write_summary(ft_dir: str, replicas: int) -> None:
    """``<ft dir>/summary.json`` from the groups' events, when the hosts wrote them where this
    machine reads (a shared ``--ft-dir``); the hosts' exit codes are not the groups', so none."""
    summary = summarize(ft_dir, replicas=replicas)
    with open(os.path.join(ft_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    print(
        f"shardwise run: ft: {summary['committed_steps']} step(s) committed, {summary['discarded_steps']} discarded, "
        f"{summary['healed_replicas']} heal(s), {summary['seconds_lost']:.1f} s lost "
        f"({os.path.join(ft_dir, 'summary.json')})",
        file=sys.stderr,
        flush=True,
    )


def launch_groups_on_hosts(options: RunOptions, launch: HostLaunch, ft: FtOptions) -> int:
    """Pre-flight, the lighthouse (unless ``--lighthouse``), every group's hosts, stop together."""
    check_ft_hosts(options, ft, launch.rdzv_store)
    split_hosts(launch.hosts, ft.replicas)
    choice = store_choice(launch.rdzv_store, dynamic=True)
    hosted = None
    if choice.kind == "launcher":
        from shardwise.launch.store import host_store

        hosted = host_store(choice.port)
    store = endpoint(choice.host, choice.port) if choice.kind == "host" and choice.host else None
    pre, target = preflight(options, launch, store=store, store_client_port=hosted.port if hosted else None)
    back_here = [str((f.facts or {}).get("store_addr")) for f in pre.facts]
    endpoints = [endpoint(addr, hosted.port) for addr in back_here] if hosted else [str(store)] * len(launch.hosts)
    server = None
    if ft.lighthouse:
        lighthouses = [ft.lighthouse] * len(launch.hosts)
    else:
        server, local = start_lighthouse(0, ft)
        lighthouses = [endpoint(addr, int(local.rsplit(":", 1)[1])) for addr in back_here]
    nodes = group_nodes(options, launch.hosts, ft, store_endpoints=endpoints, lighthouses=lighthouses,
                        run_id=options.rdzv_id or uuid.uuid4().hex[:12], hang_timeout_s=launch.hang_timeout_s)
    size = len(launch.hosts) // ft.replicas
    print(
        f"shardwise run: pre-flight ok on {len(launch.hosts)} host(s) ({pre.versions()}); {ft.replicas} replica "
        f"group(s) of {size} host(s), lighthouse "
        f"{'at ' + ft.lighthouse if ft.lighthouse else 'on this machine, ' + lighthouses[0]}, "
        f"min_replicas={ft.min_replicas}",
        file=sys.stderr,
        flush=True,
    )
    sessions = []
    for node in nodes:
        argv = [target.python, "-m", "shardwise", "run", *node.args]
        rejoin = f"cd {shlex.quote(target.chdir)} && {shlex.join(a for a in argv if a != '--stop-with-stdin')}"
        sessions.append(
            Session(
                node.host.name,
                tuple(ssh_argv(node.host.name, remote_command(argv, env=target.env, chdir=target.chdir), launch.ssh)),
                rejoin=rejoin,
            )
        )
    try:
        with Sessions(sessions, stop_grace_s=launch.stop_grace_s) as running:
            outcome = running.wait(min_alive=ft.min_replicas * size, finish_grace_s=ft.timeout_s)
    finally:
        if server is not None:
            server.shutdown()
    del hosted  # the store lived until every host had stopped
    if ft.ft_dir and os.path.isdir(ft.ft_dir):  # --ft-dir on a file system this machine shares with the hosts
        write_summary(ft.ft_dir, ft.replicas)
    if outcome.interrupted:
        print("shardwise run: interrupted; every host was stopped", file=sys.stderr, flush=True)
    elif outcome.exit_code != 0:
        print(f"shardwise run: error: host {outcome.failed} failed with exit code {outcome.failed_code} and fewer than "
              f"{ft.min_replicas} group(s) were left; every other host was stopped", file=sys.stderr, flush=True)
    return outcome.exit_code
