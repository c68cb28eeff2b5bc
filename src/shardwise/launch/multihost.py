"""``shardwise run --hostfile FILE`` / ``--hosts h1:4,h2:4``: start every node from this machine.

What happens, in order:

1. the hosts are read (:mod:`shardwise.launch.hosts`); node rank = position, node 0 is the master;
2. pre-flight checks every host over ssh (:mod:`shardwise.launch.preflight`); any problem stops
   here, one line per problem, nothing started;
3. one ssh session per host runs the ordinary ``shardwise run`` there with that node's flags
   (``--nnodes``, ``--node-rank``, ``--master-addr/--master-port``; for ``--nnodes MIN:MAX`` or
   restarts the ``c10d`` rendezvous, its store on a machine that does not train: by default this
   launcher, which must live as long as the job anyway, so that no node is special; see
   :func:`store_choice`), the forwarded environment, in the same working directory (or
   ``--chdir``), with ``--stop-with-stdin``;
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
from shardwise.launch.store import parse_endpoint

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
    rdzv_store: str | None = None  # --rdzv-store: launcher[:PORT], node0 or HOST:PORT (see store_choice)


@dataclass(frozen=True)
class StoreChoice:
    """Where the c10d rendezvous store lives: ``node0`` (hosted by the first host's agent, as
    torchrun does: losing that node ends the job), ``launcher`` (this process, at ``port``, 0 for
    a free one) or ``host`` (a running ``shardwise rendezvous`` at ``host:port``)."""

    kind: str
    host: str | None = None
    port: int = 0


def uses_c10d(options: RunOptions, elastic: bool) -> bool:
    """Whether the nodes meet through the c10d rendezvous (a world that can re-form)."""
    return elastic or options.rdzv_backend == "c10d" or options.max_restarts > 0


def store_choice(value: str | None, *, dynamic: bool) -> StoreChoice:
    """``--rdzv-store`` (default: the launcher when the world can re-form, else nothing to host)."""
    if value is None:
        return StoreChoice("launcher") if dynamic else StoreChoice("node0")
    if value == "node0":
        return StoreChoice("node0")
    if not dynamic:
        raise LaunchError(
            f"--rdzv-store {value} needs a world that can re-form",
            hint="add --nnodes MIN:MAX or --max-restarts N (a fixed world uses node 0's static rendezvous)",
        )
    if value == "launcher":
        return StoreChoice("launcher")
    if value.startswith("launcher:"):
        port = value.partition(":")[2]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(
                f"--rdzv-store {value!r}: {port!r} is not a port", hint="for example --rdzv-store launcher:29400"
            )
        return StoreChoice("launcher", port=int(port))
    host, port = parse_endpoint(value, "--rdzv-store")
    return StoreChoice("host", host, port)


def endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class World:
    """The shape every node is told: node count (``N`` or ``MIN:MAX``), master, rendezvous."""

    nnodes: str
    elastic: bool
    master_addr: str
    master_port: int
    run_id: str
    store_endpoints: tuple[str, ...] = ()  # per node: where it reaches a store off the nodes (else node 0 hosts it)


def check_topology(options: RunOptions, hosts: Sequence[Host]) -> tuple[str, bool]:
    """``--nnodes`` for the hosts (default: all of them) and whether the world is elastic."""
    if options.node_rank is not None:
        raise LaunchError(
            "--node-rank cannot be combined with --hostfile/--hosts",
            hint="the order of the hosts gives each its node rank",
        )
    if options.rdzv_endpoint:
        raise LaunchError(
            "--rdzv-endpoint cannot be combined with --hostfile/--hosts",
            hint="use --rdzv-store HOST:PORT for a running 'shardwise rendezvous' (by default this launcher hosts the "
            "store)",
        )
    low, high = parse_nnodes(options.nnodes or str(len(hosts)))
    if low == high and low != len(hosts):
        raise LaunchError(
            f"--nnodes {low} but {len(hosts)} hosts are listed", hint="drop --nnodes, or list that many hosts"
        )
    if high < len(hosts) or low > len(hosts):
        raise LaunchError(f"--nnodes {low}:{high} does not admit the {len(hosts)} hosts listed",
                          hint=f"use MIN <= {len(hosts)} <= MAX, e.g. --nnodes 1:{len(hosts)}")
    return (f"{low}:{high}" if low != high else str(low)), low != high


def node_args(
    options: RunOptions, host: Host, node_rank: int, world: World, *, hang_timeout_s: float | None
) -> list[str]:
    """The ``shardwise run`` arguments of node ``node_rank`` (after ``python -m shardwise run``)."""
    args = [
        "--stop-with-stdin",
        "--nproc-per-node",
        str(host.slots or options.nproc_per_node),
        "--nnodes",
        world.nnodes,
        "--rdzv-timeout",
        str(options.rdzv_timeout_s),
        "--max-restarts",
        str(options.max_restarts),
    ]
    if uses_c10d(options, world.elastic):
        # The c10d rendezvous, so that a restart re-forms the whole world (the static one cannot
        # restart across nodes). Its store lives off the nodes (every node a client), or node 0
        # hosts it: no guessing from host names (aliases).
        hosts_store = not world.store_endpoints and node_rank == 0
        where = (
            world.store_endpoints[node_rank] if world.store_endpoints else f"{world.master_addr}:{world.master_port}"
        )
        conf = ",".join(filter(None, [options.rdzv_conf, f"is_host={int(hosts_store)}"]))
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", where, "--rdzv-id", world.run_id, "--rdzv-conf", conf]
    else:
        args += [
            "--node-rank",
            str(node_rank),
            "--master-addr",
            world.master_addr,
            "--master-port",
            str(world.master_port),
        ]
        if options.rdzv_conf:
            args += ["--rdzv-conf", options.rdzv_conf]
    if options.log_dir:
        args += ["--log-dir", options.log_dir]
    if options.log_prefix:
        args += ["--log-prefix", options.log_prefix]
    if hang_timeout_s is not None:
        args += ["--hang-timeout", f"{hang_timeout_s:g}"]
    if options.module:
        args.append("-m")
    return args + [options.script, *options.script_args]


def preflight(options: RunOptions, launch: HostLaunch, *, store: str | None = None,
              store_client_port: int | None = None) -> tuple[Preflight, Target]:
    """Pre-flight of every host for this job (raises one LaunchError listing the problems)."""
    target = Target(
        python=launch.python or sys.executable,
        chdir=launch.chdir or os.getcwd(),
        script=options.script,
        module=options.module,
        master_addr=options.master_addr or resolve_hostname(launch.hosts[0].name, launch.ssh),
        master_port=options.master_port,
        env=forwarded_env(os.environ, launch.env_names),
        store=store,
        store_client_port=store_client_port,
    )
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
    choice = store_choice(launch.rdzv_store, dynamic=uses_c10d(options, elastic))
    hosted = None
    if (
        choice.kind == "launcher"
    ):  # torch's TCPStore in this process, alive as long as the job (see shardwise.launch.store)
        from shardwise.launch.store import host_store

        hosted = host_store(choice.port)
    store = endpoint(choice.host, choice.port) if choice.kind == "host" and choice.host else None
    pre, target = preflight(options, launch, store=store, store_client_port=hosted.port if hosted else None)
    if show_hosts:
        print("pre-flight:\n" + "\n".join(host_lines(pre)), flush=True)
    if hosted is not None:  # each host reaches this machine at the address its ssh session comes from
        endpoints = tuple(endpoint(str((f.facts or {})["store_addr"]), hosted.port) for f in pre.facts)
        where = f"rendezvous store on this machine, port {hosted.port}"
    else:
        endpoints = (store,) * len(launch.hosts) if store else ()
        where = f"rendezvous store at {store}" if store else "rendezvous store on node 0"
    world = World(nnodes=nnodes, elastic=elastic, master_addr=target.master_addr,
                  master_port=pre.master_port or DEFAULT_MASTER_PORT, run_id=options.rdzv_id or uuid.uuid4().hex[:12],
                  store_endpoints=endpoints)
    print(
        f"shardwise run: pre-flight ok on {len(launch.hosts)} host(s) ({pre.versions()}); master "
        f"{world.master_addr}:{world.master_port}, "
        + (f"elastic {nnodes} nodes, rendezvous id {world.run_id}" if elastic else f"{nnodes} node(s)")
        + (f", {where}" if uses_c10d(options, elastic) else ""),
        file=sys.stderr,
        flush=True,
    )
    sessions = []
    for rank, host in enumerate(launch.hosts):
        argv = [
            target.python,
            "-m",
            "shardwise",
            "run",
            *node_args(options, host, rank, world, hang_timeout_s=launch.hang_timeout_s),
        ]
        # typed by hand there, a returning host joins as a node without the store; the forwarded
        # environment is left out of the printed line (it may hold secrets)
        by_hand = [a.replace("is_host=1", "is_host=0") for a in argv if a != "--stop-with-stdin"]
        rejoin = f"cd {shlex.quote(target.chdir)} && {shlex.join(by_hand)}" if elastic else ""
        ssh_line = ssh_argv(host.name, remote_command(argv, env=target.env, chdir=target.chdir), launch.ssh)
        sessions.append(Session(host.name, tuple(ssh_line), rejoin=rejoin))
    with Sessions(sessions, stop_grace_s=launch.stop_grace_s) as running:
        outcome = running.wait(min_alive=parse_nnodes(nnodes)[0] if elastic else None)
    del hosted  # the store lived until every host had stopped
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
