"""Turn ``shardwise run`` flags (and a Slurm allocation) into torch's elastic ``LaunchConfig``.

This is a pure function of the flags and the environment, so every branch is unit-tested
without starting a process. The rendezvous rules follow torchrun:

- one node, no port given: the ``c10d`` rendezvous on ``127.0.0.1`` and a free port (loopback only);
- a fixed world (``--nnodes N`` with ``--master-addr``): the ``static`` rendezvous, node 0 hosts the
  store at ``master_addr:master_port``, ``--node-rank`` orders the nodes;
- an elastic world (``--nnodes MIN:MAX``): the ``c10d`` rendezvous at ``--rdzv-endpoint``;
- inside ``srun``: node count, node rank and master come from Slurm's variables.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import math
import os
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Mapping

from typing import TYPE_CHECKING

from shardwise.errors import LaunchError
from shardwise.launch.probe import free_port, port_free
from shardwise.runtime.detect import slurm_nodelist, slurm_port
from shardwise.runtime.settings import ELASTIC_VAR
from shardwise.runtime.slurm import first_host

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

DEFAULT_RDZV_TIMEOUT_S = 300
WORKER_MAIN = "shardwise.launch.worker_main"  # each worker's entry: line-buffered output, then the target
MAX_AUTO_CPU_PROCS = 4


@dataclass(frozen=True)
class RunOptions:
    """What the user asked for on the ``shardwise run`` command line."""

    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    nproc_per_node: str = "auto"
    nnodes: str | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_timeout_s: int = DEFAULT_RDZV_TIMEOUT_S
    rdzv_conf: str | None = None  # torchrun's --rdzv-conf "key=value,key=value"
    max_restarts: int = 0
    log_dir: str | None = None
    log_prefix: str | None = None  # torch's log_line_prefix_template: ${rank}, ${local_rank}, ${role_name}
    monitor_interval_s: float = 0.1


@dataclass(frozen=True)
class ResolvedLaunch:
    """Everything ``elastic_launch`` needs, plus the environment the workers get on top of ours."""

    config: LaunchConfig
    entrypoint: str
    args: tuple[str, ...]
    worker_env: Mapping[str, str] = field(default_factory=dict)
    temp_log_dir: str | None = None  # made for --log-prefix without --log-dir; removed after the run


def hang_timeout_env(seconds: float | None) -> dict[str, str]:
    """``--hang-timeout`` as the variable the workers' :func:`shardwise.init` reads (empty when not given)."""
    if seconds is None:
        return {}
    if not math.isfinite(seconds):
        raise LaunchError(
            f"--hang-timeout {seconds:g} is not a number of seconds", hint="give seconds, or 0 to disable the watchdog"
        )
    if seconds < 0:
        raise LaunchError(f"--hang-timeout {seconds:g} is negative", hint="give seconds, or 0 to disable the watchdog")
    return {"SHARDWISE_HANG_TIMEOUT": f"{seconds:g}"}


def auto_nproc(environ: Mapping[str, str]) -> int:
    """One process per visible GPU; on CPUs one per core, at most four (each uses several threads)."""
    import torch  # here, so that parsing flags (``shardwise run --help``) needs no torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    gpus_on_node = environ.get("SLURM_GPUS_ON_NODE", "")
    if gpus_on_node.isdigit() and int(gpus_on_node) > 0:
        return int(gpus_on_node)
    return max(1, min(os.cpu_count() or 1, MAX_AUTO_CPU_PROCS))


def parse_nproc(value: str, environ: Mapping[str, str]) -> int:
    if value in ("auto", "gpu", "cpu"):
        return auto_nproc(environ) if value != "cpu" else max(1, min(os.cpu_count() or 1, MAX_AUTO_CPU_PROCS))
    try:
        n = int(value)
    except ValueError:
        raise LaunchError(
            f"--nproc-per-node {value!r} is not a number", hint="give a positive integer or 'auto'"
        ) from None
    if n < 1:
        raise LaunchError(f"--nproc-per-node {n} must be at least 1", hint="give a positive integer or 'auto'")
    return n


def parse_nnodes(value: str) -> tuple[int, int]:
    try:
        lo, _, hi = value.partition(":")
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise LaunchError(
            f"--nnodes {value!r} is not N or MIN:MAX", hint="for example --nnodes 2 or --nnodes 1:4"
        ) from None
    if not 0 < low <= high:
        raise LaunchError(f"--nnodes {value!r} needs 0 < MIN <= MAX", hint="for example --nnodes 2 or --nnodes 1:4")
    return low, high


def check_port_free(port: int) -> None:
    """Fail early, with advice, when the rendezvous port on this host is taken."""
    if not port_free(port):
        raise LaunchError(f"port {port} is already in use on this host",
                          hint="pick another --master-port, or omit it on a single node to get a free one")


def check_resolvable(host: str, flag: str) -> None:
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror:
        raise LaunchError(
            f"{flag} {host!r} does not resolve to an address",
            hint="use the IP address or a host name of node 0 that every node can resolve",
        ) from None


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """torchrun's ``--rdzv-conf key=value,key=value`` (e.g. ``last_call_timeout=5,is_host=1``)."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise LaunchError(
                f"--rdzv-conf item {item!r} is not key=value",
                hint="for example --rdzv-conf last_call_timeout=5,is_host=1",
            )
        out[key.strip()] = value.strip()
    return out


def _check_target(options: RunOptions) -> None:
    if options.module:
        # where `python -m` looks: the current directory first (a console script's own sys.path
        # starts with its bin/ directory instead), then PYTHONPATH and the installed packages
        top = options.script.split(".")[0]
        if (
            importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is None
            and importlib.util.find_spec(top) is None
        ):
            raise LaunchError(
                f"module {options.script!r} cannot be imported", hint="check the name and your PYTHONPATH"
            )
    elif not os.path.isfile(options.script):
        raise LaunchError(
            f"script {options.script!r} does not exist", hint="check the path (it is relative to the current directory)"
        )


@dataclass(frozen=True)
class _Topology:
    min_nodes: int
    max_nodes: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    run_id: str | None


def _topology(options: RunOptions, environ: Mapping[str, str]) -> _Topology:
    in_srun = "SLURM_STEP_ID" in environ and "SLURM_NNODES" in environ and options.nnodes is None
    if in_srun:
        nodes = int(environ["SLURM_NNODES"])
        tasks = int(environ.get("SLURM_NTASKS", nodes))
        if tasks != nodes:
            raise LaunchError(
                f"srun started {tasks} tasks on {nodes} nodes, but 'shardwise run' must be one task per node",
                hint="use 'srun --ntasks-per-node=1 shardwise run ...' (shardwise starts the per-GPU processes)",
            )
        return _Topology(
            nodes,
            nodes,
            int(environ.get("SLURM_NODEID", "0")) if options.node_rank is None else options.node_rank,
            options.master_addr or first_host(slurm_nodelist(environ)),
            options.master_port or slurm_port(environ),
            options.rdzv_id or environ.get("SLURM_JOB_ID"),
        )
    low, high = parse_nnodes(options.nnodes or "1")
    return _Topology(low, high, options.node_rank or 0, options.master_addr, options.master_port, options.rdzv_id)


def resolve(options: RunOptions, environ: Mapping[str, str] | None = None) -> ResolvedLaunch:
    """Check the flags and build torch's ``LaunchConfig`` (see the module doc for the rules)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    environ = os.environ if environ is None else environ
    _check_target(options)
    nproc = parse_nproc(options.nproc_per_node, environ)
    if options.max_restarts < 0:
        raise LaunchError(f"--max-restarts {options.max_restarts} is negative", hint="use 0 or more")
    if options.rdzv_timeout_s <= 0:
        raise LaunchError(f"--rdzv-timeout {options.rdzv_timeout_s} must be positive", hint="use seconds, e.g. 300")
    topo = _topology(options, environ)
    if not 0 <= topo.node_rank < topo.max_nodes:
        raise LaunchError(
            f"--node-rank {topo.node_rank} is outside 0..{topo.max_nodes - 1}",
            hint=f"give each of the {topo.max_nodes} nodes a rank from 0 to {topo.max_nodes - 1}",
        )
    backend, endpoint, local_addr, rdzv_configs = _rendezvous(options, topo)

    # Each rank's output: straight to this process's stdout/stderr (inherited), one whole line per
    # write (shardwise.launch.worker_main). With --log-dir or --log-prefix, torch's agent writes
    # it to <log_dir>/<run id>/attempt_<n>/<local rank>/{stdout,stderr}.log and copies each line
    # to the console behind the prefix (its default: [shardwise<local rank>]:).
    if options.log_prefix is not None and not options.log_prefix.strip():
        raise LaunchError(
            "--log-prefix is empty", hint="for example --log-prefix '[${rank}]: ', or leave it out for no prefix"
        )
    temp_log_dir = None
    if options.log_dir:
        os.makedirs(options.log_dir, exist_ok=True)
    elif options.log_prefix:
        temp_log_dir = tempfile.mkdtemp(prefix="shardwise-logs-")
    tee = Std.ALL if options.log_dir or options.log_prefix else Std.NONE
    config = LaunchConfig(
        min_nodes=topo.min_nodes,
        max_nodes=topo.max_nodes,
        nproc_per_node=nproc,
        run_id=topo.run_id or (str(uuid.uuid4()) if topo.max_nodes == 1 else "none"),
        role="shardwise",
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=options.max_restarts,
        monitor_interval=options.monitor_interval_s,
        start_method="spawn",
        local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=options.log_dir or temp_log_dir, redirects=Std.NONE, tee=tee),
        log_line_prefix_template=options.log_prefix,
    )
    args = ["-m", WORKER_MAIN] + (["-m"] if options.module else []) + [options.script, *options.script_args]
    from shardwise.launch.forkserver import worker_command  # run with -m: imported when used

    args = worker_command(args, environ)  # forked from a fork server that imported torch once, if one is named
    worker_env = _worker_env(topo, backend=backend, nproc=nproc, environ=environ)
    return ResolvedLaunch(
        config=config, entrypoint=sys.executable, args=tuple(args), worker_env=worker_env, temp_log_dir=temp_log_dir
    )


def _rendezvous(options: RunOptions, topo: _Topology) -> tuple[str, str, str | None, dict[str, object]]:
    """``(backend, endpoint, local_addr, rdzv_configs)`` of torch's rendezvous for this topology:
    c10d for an elastic world or a given endpoint, c10d on a free local port for one node that
    names no master, else static at the master's address (checked: resolvable, port free on node 0)."""
    rdzv_configs: dict[str, object] = {"timeout": options.rdzv_timeout_s, "join_timeout": options.rdzv_timeout_s,
                                       **parse_rdzv_conf(options.rdzv_conf)}
    local_addr = None
    backend = options.rdzv_backend
    if topo.min_nodes != topo.max_nodes:
        backend = backend or "c10d"
        if backend == "static" or not options.rdzv_endpoint:
            raise LaunchError(
                f"an elastic world (--nnodes {topo.min_nodes}:{topo.max_nodes}) needs a dynamic rendezvous",
                hint="add --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB",
            )
        endpoint = options.rdzv_endpoint
    elif options.rdzv_endpoint:
        backend = backend or "c10d"
        endpoint = options.rdzv_endpoint
    elif topo.max_nodes == 1 and topo.master_port is None and topo.master_addr is None:
        backend, local_addr = "c10d", "127.0.0.1"
        endpoint = f"127.0.0.1:{free_port()}"
    else:
        backend = backend or "static"
        if topo.max_nodes > 1 and topo.master_addr is None:
            raise LaunchError(
                f"--nnodes {topo.max_nodes} needs to know where node 0 is",
                hint="add --master-addr HOST (node 0's address) and --master-port PORT, or --rdzv-endpoint",
            )
        addr = topo.master_addr or "127.0.0.1"
        port = topo.master_port or 29500
        check_resolvable(addr, "--master-addr")
        if topo.node_rank == 0:
            check_port_free(port)
        if topo.max_nodes == 1:
            local_addr = addr
        endpoint = f"{addr}:{port}"
        rdzv_configs["rank"] = topo.node_rank
    if backend not in ("static", "c10d", "etcd", "etcd-v2"):
        raise LaunchError(f"--rdzv-backend {backend!r} is unknown", hint="use 'c10d' or 'static'")
    if backend == "static":
        rdzv_configs["rank"] = topo.node_rank
    return backend, endpoint, local_addr, rdzv_configs


def _worker_env(topo: _Topology, *, backend: str, nproc: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the launcher adds to every worker's environment."""
    worker_env = {}
    if topo.min_nodes != topo.max_nodes:  # the workers' Trainer re-plans when the world changed
        worker_env[ELASTIC_VAR] = f"{topo.min_nodes}:{topo.max_nodes}"
    if backend != "static" and topo.max_nodes > 1:
        # A fresh worker store for every rendezvous round (hosted by rank 0). torch's agent
        # otherwise shares one store across rounds, keyed by its own restart count, which differs
        # between nodes once one of them joined or restarted for a membership change.
        worker_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if "OMP_NUM_THREADS" not in environ:
        # Share the cores between the local processes instead of oversubscribing them.
        worker_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return worker_env
