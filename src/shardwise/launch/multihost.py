"""``shardwise run --hostfile FILE`` / ``--hosts h1:4,h2:4``: start every node from this machine.

What happens, in order:

1. the hosts are read (:mod:`shardwise.launch.hosts`); node rank = position, node 0 is the master;
2. pre-flight checks every host over ssh (:mod:`shardwise.launch.preflight`); any problem stops
   here, one line per problem, nothing started;
3. one ssh session per host runs the ordinary ``shardwise run`` there with that node's flags
   (``--nnodes``, ``--node-rank``, ``--master-addr/--master-port``; for ``--nnodes MIN:MAX`` the
   ``c10d`` rendezvous at the master with node 0 hosting its store), the forwarded environment,
   in the same working directory (or ``--chdir``), with ``--stop-with-stdin``;
4. each host's output is printed with a ``[host]`` prefix (:mod:`shardwise.launch.sessions`);
   Ctrl-C or a failed host stops every host, and the exit code is the job's.

The nodes meet through torch's own rendezvous (static, or c10d when elastic) exactly as if the
same commands had been typed on each machine; shardwise adds no agent or daemon of its own.
"""

from __future__ import annotations

import os
import shlex
import sys
import uuid
from dataclasses import dataclass
from typing import Sequence

from shardwise.errors import LaunchError
from shardwise.launch.hosts import Host
from shardwise.launch.options import RunOptions, parse_nnodes
from shardwise.launch.preflight import Preflight, Target, check, run_preflight
from shardwise.launch.sessions import DEFAULT_STOP_GRACE_S, Session, Sessions
from shardwise.launch.ssh import SshOptions, forwarded_env, remote_command, resolve_hostname, ssh_argv

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class HostLaunch:
    """The multi-host part of the command line (the per-node part is a :class:`RunOptions`)."""

    hosts: tuple[Host, ...]
    ssh: SshOptions = SshOptions()
    env_names: tuple[str, ...] = ()  # --env NAME or NAME=VALUE
    chdir: str | None = None  # default: this directory
    python: str | None = None  # default: this interpreter's path
    hang_timeout_s: float | None = None
    stop_grace_s: float = DEFAULT_STOP_GRACE_S


@dataclass(frozen=True)
class World:
    """The shape every node is told: node count (``N`` or ``MIN:MAX``), master, rendezvous."""

    nnodes: str
    elastic: bool
    master_addr: str
    master_port: int
    run_id: str


def check_topology(options: RunOptions, hosts: Sequence[Host]) -> tuple[str, bool]:
    """``--nnodes`` for the hosts (default: all of them) and whether the world is elastic."""
    if options.node_rank is not None:
        raise LaunchError("--node-rank cannot be combined with --hostfile/--hosts", hint="the order of the hosts gives each its node rank")
    if options.rdzv_endpoint:
        raise LaunchError("--rdzv-endpoint cannot be combined with --hostfile/--hosts",
                          hint="the first host is the rendezvous; use --master-addr/--master-port to change its address")
    low, high = parse_nnodes(options.nnodes or str(len(hosts)))
    if low == high and low != len(hosts):
        raise LaunchError(f"--nnodes {low} but {len(hosts)} hosts are listed", hint="drop --nnodes, or list that many hosts")
    if high < len(hosts) or low > len(hosts):
        raise LaunchError(f"--nnodes {low}:{high} does not admit the {len(hosts)} hosts listed",
                          hint=f"use MIN <= {len(hosts)} <= MAX, e.g. --nnodes 1:{len(hosts)}")
    return (f"{low}:{high}" if low != high else str(low)), low != high


def node_args(options: RunOptions, host: Host, node_rank: int, world: World, *, hang_timeout_s: float | None) -> list[str]:
    """The ``shardwise run`` arguments of node ``node_rank`` (after ``python -m shardwise run``)."""
    args = ["--stop-with-stdin", "--nproc-per-node", str(host.slots or options.nproc_per_node), "--nnodes", world.nnodes,
            "--rdzv-timeout", str(options.rdzv_timeout_s), "--max-restarts", str(options.max_restarts)]
    if world.elastic or options.rdzv_backend == "c10d" or options.max_restarts > 0:
        # The c10d rendezvous, so that a restart re-forms the whole world (the static one cannot
        # restart across nodes). Node 0 hosts its store: no guessing from host names (aliases).
        conf = ",".join(filter(None, [options.rdzv_conf, f"is_host={1 if node_rank == 0 else 0}"]))
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{world.master_addr}:{world.master_port}",
                 "--rdzv-id", world.run_id, "--rdzv-conf", conf]
    else:
        args += ["--node-rank", str(node_rank), "--master-addr", world.master_addr, "--master-port", str(world.master_port)]
        if options.rdzv_conf:
            args += ["--rdzv-conf", options.rdzv_conf]
    if options.log_dir:
        args += ["--log-dir", options.log_dir]
    if hang_timeout_s is not None:
        args += ["--hang-timeout", f"{hang_timeout_s:g}"]
    if options.module:
        args.append("-m")
    return args + [options.script, *options.script_args]


def preflight(options: RunOptions, launch: HostLaunch) -> tuple[Preflight, Target]:
    """Pre-flight of every host for this job (raises one LaunchError listing the problems)."""
    target = Target(python=launch.python or sys.executable, chdir=launch.chdir or os.getcwd(), script=options.script,
                    module=options.module, master_addr=options.master_addr or resolve_hostname(launch.hosts[0].name, launch.ssh),
                    master_port=options.master_port, env=forwarded_env(os.environ, launch.env_names))
    return check(run_preflight(launch.hosts, target, launch.ssh)), target


def host_lines(pre: Preflight) -> list[str]:
    """One line per host of a passed pre-flight (``shardwise doctor --hostfile`` prints them)."""
    lines = []
    for rank, f in enumerate(pre.facts):
        facts = f.facts or {}
        lines.append(f"  node {rank}  {f.host.name:<20} ok: {facts.get('hostname')}, python {facts.get('python')}, "
                     f"torch {facts.get('torch')}, shardwise {facts.get('shardwise')}")
    return lines


def launch_on_hosts(options: RunOptions, launch: HostLaunch, *, show_hosts: bool = False) -> int:
    """Pre-flight, start every node, stream, stop together; returns the job's exit code."""
    nnodes, elastic = check_topology(options, launch.hosts)
    pre, target = preflight(options, launch)
    if show_hosts:
        print("pre-flight:\n" + "\n".join(host_lines(pre)), flush=True)
    world = World(nnodes=nnodes, elastic=elastic, master_addr=target.master_addr,
                  master_port=pre.master_port or DEFAULT_MASTER_PORT, run_id=options.rdzv_id or uuid.uuid4().hex[:12])
    print(f"shardwise run: pre-flight ok on {len(launch.hosts)} host(s) ({pre.versions()}); master "
          f"{world.master_addr}:{world.master_port}, " + (f"elastic {nnodes} nodes, rendezvous id {world.run_id}" if elastic
                                                           else f"{nnodes} node(s)"), file=sys.stderr, flush=True)
    sessions = []
    for rank, host in enumerate(launch.hosts):
        argv = [target.python, "-m", "shardwise", "run", *node_args(options, host, rank, world, hang_timeout_s=launch.hang_timeout_s)]
        # typed by hand there, a returning host joins as a node without the store; the forwarded
        # environment is left out of the printed line (it may hold secrets)
        by_hand = [a.replace("is_host=1", "is_host=0") for a in argv if a != "--stop-with-stdin"]
        rejoin = f"cd {shlex.quote(target.chdir)} && {shlex.join(by_hand)}" if elastic else ""
        ssh_line = ssh_argv(host.name, remote_command(argv, env=target.env, chdir=target.chdir), launch.ssh)
        sessions.append(Session(host.name, tuple(ssh_line), rejoin=rejoin))
    with Sessions(sessions, stop_grace_s=launch.stop_grace_s) as running:
        outcome = running.wait(min_alive=parse_nnodes(nnodes)[0] if elastic else None)
    if outcome.interrupted:
        print("shardwise run: interrupted; every host was stopped", file=sys.stderr, flush=True)
    elif outcome.exit_code != 0:
        rank = next(i for i, h in enumerate(launch.hosts) if h.name == outcome.failed)
        how = ("its ssh session ended (exit code 255: the connection dropped or the remote side was killed)"
               if outcome.failed_code == 255 else f"exit code {outcome.failed_code}")
        print(f"shardwise run: error: host {outcome.failed} (node {rank}) failed, {how}; every other host was stopped; "
              f"its output is above (lines starting [{outcome.failed}])", file=sys.stderr, flush=True)
    return outcome.exit_code


def doctor_on_hosts(launch: HostLaunch, *, nproc: int | None, max_size_mb: float | None, iters: int) -> int:
    """``shardwise doctor --hostfile``: pre-flight (every host printed), then the collective
    checks and bandwidth table across all hosts (:mod:`shardwise.observe.doctor_world`)."""
    args = ["--iters", str(iters)] + (["--max-size-mb", f"{max_size_mb:g}"] if max_size_mb is not None else [])
    options = RunOptions(script="shardwise.observe.doctor_world", module=True, script_args=tuple(args),
                         nproc_per_node=str(nproc) if nproc else "auto", rdzv_timeout_s=120)
    if nproc == 0:  # --nproc 0: the checks of every host only, no collectives
        check_topology(options, launch.hosts)
        print("pre-flight:\n" + "\n".join(host_lines(preflight(options, launch)[0])), flush=True)
        return 0
    return launch_on_hosts(options, launch, show_hosts=True)
