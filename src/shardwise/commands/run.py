"""``shardwise run``: start N processes of a script on this node, or on every node of a hostfile over ssh
(torchrun-compatible)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from shardwise.errors import LaunchError
from shardwise.commands.host_flags import add_host_flags, host_launch_from_args
from shardwise.launch.options import DEFAULT_RDZV_TIMEOUT_S, RunOptions, hang_timeout_env, resolve


EXAMPLES = """examples:
  shardwise run --nproc-per-node 4 train.py --lr 3e-4
  shardwise run -m mypkg.train
  # two nodes (run on each, with its own --node-rank):
  shardwise run --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr node0 --master-port 29500 train.py
  # elastic, 1 to 4 nodes, restart up to 3 times:
  shardwise run --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job7 --max-restarts 3 train.py
  # inside a Slurm allocation (one task per node; nodes, rank and master come from Slurm):
  srun --ntasks-per-node=1 shardwise run train.py
  # every node from here over ssh (hostfile lines 'node1 slots=8'; pre-flight checks each host first):
  shardwise run --hostfile hosts.txt train.py --lr 3e-4
  shardwise run --hosts node1:8,node2:8 --env WANDB_API_KEY --chdir /shared/proj train.py
  shardwise run --hostfile hosts.txt --nnodes 1:2 --max-restarts 3 train.py   # keeps training if any node is lost
  # the rendezvous store on a machine that does not train (start 'shardwise rendezvous' there first):
  shardwise run --nnodes 1:4 --rdzv-endpoint login1:29400 --rdzv-conf is_host=0 --rdzv-id job7 --max-restarts 3 train.py
  # per-step fault tolerance (shardwise[ft]): 2 replica groups of 4 processes, each restarts on its own:
  shardwise run --ft-replicas 2 --nproc-per-node 4 --max-restarts 3 train.py
  # the same over machines: 'shardwise lighthouse --port 29510' on one, then on each (here group 1 of 2):
  shardwise run --ft-replicas 2 --ft-replica-id 1 --lighthouse login1:29510 --nproc-per-node 8 --max-restarts 3 train.py
  # or from here over ssh: 4 hosts, 2 groups of 2, the lighthouse on this machine:
  shardwise run --hostfile hosts.txt --ft-replicas 2 --max-restarts 3 train.py
  # each line whole, behind its rank; every rank's output also in its own file:
  shardwise run --nproc-per-node 4 --log-prefix '[${rank}]: ' --log-dir logs train.py
"""


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The torchrun-compatible flags (also used by ``shardwise train``)."""
    g = parser.add_argument_group("launch (torchrun-compatible)")
    g.add_argument("--nproc-per-node", "--nproc_per_node", default="auto", metavar="N",
                   help="processes on this node: a number, or 'auto' (one per GPU, else up to 4 CPU processes)")
    g.add_argument("--nnodes", default=None, metavar="N|MIN:MAX", help="number of nodes, or a range for an elastic job")
    g.add_argument("--node-rank", "--node_rank", type=int, default=None, help="this node's rank (static rendezvous)")
    g.add_argument("--master-addr", "--master_addr", default=None, help="address of node 0")
    g.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help="port on node 0 (default: a free port on one node)",
    )
    g.add_argument("--rdzv-backend", "--rdzv_backend", default=None, choices=["c10d", "static", "etcd", "etcd-v2"])
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT")
    g.add_argument("--rdzv-id", "--rdzv_id", default=None, help="job id shared by all nodes of an elastic job")
    g.add_argument("--rdzv-timeout", type=int, default=DEFAULT_RDZV_TIMEOUT_S, metavar="SECONDS",
                   help="give up if the nodes have not met within this time (default %(default)s)")
    g.add_argument("--rdzv-conf", "--rdzv_conf", default=None, metavar="KEY=VALUE,...",
                   help="more rendezvous settings, e.g. last_call_timeout=5,keep_alive_interval=2,is_host=1")
    g.add_argument(
        "--max-restarts", "--max_restarts", type=int, default=0, help="restart the group this many times on failure"
    )
    g.add_argument("--log-dir", "--log_dir", default=None,
                   help="also keep each rank's stdout/stderr in a file under this directory "
                        "(DIR/<run id>/attempt_<n>/<local rank>/stdout.log)")
    g.add_argument(
        "--log-prefix",
        "--log-line-prefix-template",
        "--log_line_prefix_template",
        default=None,
        metavar="TEMPLATE",
        help="start each line of a worker's output with this, e.g. '[${rank}]: ' (${rank}, ${local_rank}, "
        "${role_name}; default: $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else none, or torch's "
        "[shardwise<local rank>]: with --log-dir)",
    )
    g.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS",
                   help="a collective or step without progress for this long makes every rank dump its stack, name the "
                        "stuck rank and exit non-zero (default: $SHARDWISE_HANG_TIMEOUT, else 300; 0 disables)")


def options_from_args(args: argparse.Namespace, script: str, script_args: list[str], module: bool) -> RunOptions:
    return RunOptions(
        script=script,
        script_args=tuple(script_args),
        module=module,
        nproc_per_node=str(args.nproc_per_node),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_timeout_s=args.rdzv_timeout,
        rdzv_conf=args.rdzv_conf,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        log_prefix=args.log_prefix
        if args.log_prefix is not None
        else (os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None),
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="start N processes of a script (torchrun-compatible)",
        description="Start processes of a training script with torch's elastic agent, the engine behind torchrun.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_flags(p)
    add_host_flags(p)
    p.add_argument(
        "--rdzv-store",
        default=None,
        metavar="launcher[:PORT]|node0|HOST:PORT",
        help="with --hostfile/--hosts and a world that can re-form: where the rendezvous store lives; 'launcher' "
        "(default: this machine, so that any node may be lost), 'node0' (the first host, as torchrun), or "
        "HOST:PORT of a running 'shardwise rendezvous'; pre-flight checks that every host reaches it",
    )
    p.add_argument("--stop-with-stdin", action="store_true",
                   help="stop every process of this node when stdin closes (what --hostfile runs on each host)")
    add_ft_flags(p)
    p.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=_main)


def _check_flags(args: argparse.Namespace) -> None:
    """What :func:`shardwise.launch.options.resolve` does not check, before it creates the log
    directory or binds a port."""
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise LaunchError(
            f"--master-port {args.master_port} is not a port", hint="use 1-65535, e.g. --master-port 29500"
        )
    if not args.module and os.path.isdir(args.script):
        raise LaunchError(
            f"script {args.script!r} is a directory", hint="give the training script's file, or -m for a module"
        )
    if args.log_dir and os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
        raise LaunchError(
            f"--log-dir {args.log_dir!r} is not a directory", hint="give a directory (it is created if missing)"
        )


def add_ft_flags(parser: argparse.ArgumentParser) -> None:
    """Per-step fault tolerance with torchft (shardwise.launch.ft, docs/multinode.md)."""
    g = parser.add_argument_group("fault-tolerant replica groups (torchft: pip install 'shardwise[ft]')")
    g.add_argument(
        "--ft-replicas",
        type=int,
        default=None,
        metavar="R",
        help="R replica groups of --nproc-per-node processes each (the outer data-parallel dimension); a failed "
        "group restarts on its own while the others keep stepping",
    )
    g.add_argument(
        "--ft-replica-id", type=int, default=None, metavar="r", help="run only group r here (with --lighthouse)"
    )
    g.add_argument(
        "--lighthouse", default=None, metavar="HOST:PORT", help="a running 'shardwise lighthouse' (default: one here)"
    )
    g.add_argument(
        "--ft-min-replicas",
        type=int,
        default=1,
        metavar="K",
        help="fewest live groups that may commit a step (default 1)",
    )
    g.add_argument(
        "--ft-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="cross-group collective, vote and heal timeout (default 30)",
    )
    g.add_argument(
        "--ft-quorum-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="wait this long for a quorum, then exit (default 60)",
    )
    g.add_argument("--ft-heartbeat-timeout", type=float, default=5.0, metavar="S",
                   help="the lighthouse drops a group silent for this long (default 5)")
    g.add_argument("--ft-join-timeout", type=float, default=1.0, metavar="S",
                   help="the lighthouse waits this long for more groups before forming a quorum (default 1)")
    g.add_argument(
        "--ft-dir", default=None, metavar="DIR", help="events and summary.json (default: <log-dir>/ft, else a temp dir)"
    )


def _ft_main(args: argparse.Namespace) -> int | None:
    """``--ft-replicas R``: the lighthouse and R groups here (returns their exit code); with
    ``--ft-replica-id``: this group's variables set, then the ordinary launch below (None)."""
    from shardwise.launch.ft import FtOptions, run_groups, worker_env

    options = FtOptions(
        replicas=args.ft_replicas,
        replica_id=args.ft_replica_id,
        lighthouse=args.lighthouse,
        min_replicas=args.ft_min_replicas,
        timeout_s=args.ft_timeout,
        quorum_timeout_s=args.ft_quorum_timeout,
        heartbeat_timeout_s=args.ft_heartbeat_timeout,
        join_timeout_s=args.ft_join_timeout,
        ft_dir=args.ft_dir,
    )
    options.check()
    options.check_hang_timeout(args.hang_timeout)
    if args.hostfile or args.hosts:  # the groups over the hosts, the lighthouse here (shardwise.launch.ft_hosts)
        from shardwise.launch.ft_hosts import launch_groups_on_hosts

        hang_timeout_env(args.hang_timeout)
        run_options = options_from_args(args, args.script, args.script_args, args.module)
        return launch_groups_on_hosts(run_options, host_launch_from_args(args, args.hang_timeout), options)
    if args.ft_replica_id is not None:
        ft_dir = args.ft_dir or (os.path.join(args.log_dir, "ft") if args.log_dir else "")
        if ft_dir:
            os.makedirs(ft_dir, exist_ok=True)
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum request at info
        os.environ.update(worker_env(options, args.ft_replica_id, args.lighthouse, ft_dir))
        return None
    several = [
        flag
        for flag, value in (
            ("--nnodes", args.nnodes),
            ("--node-rank", args.node_rank),
            ("--master-addr", args.master_addr),
            ("--master-port", args.master_port),
            ("--rdzv-endpoint", args.rdzv_endpoint),
        )
        if value is not None
    ]
    if several:
        raise LaunchError(
            f"--ft-replicas {args.ft_replicas} starts every group on this machine; {several[0]} is for a group "
            "over several machines",
            hint="start each such group with --ft-replica-id r --lighthouse HOST:PORT",
        )
    _check_flags(args)
    resolve(options_from_args(args, args.script, args.script_args, args.module))  # refuse bad flags once, here
    # A group's own rendezvous has one node: its agents' heartbeat (15 s by default) can only drop
    # the group from itself (a loaded machine), and a lost group is torchft's to notice.
    child = ["--nproc-per-node", str(args.nproc_per_node), "--max-restarts", str(args.max_restarts),
             "--rdzv-timeout", str(args.rdzv_timeout), "--rdzv-conf", args.rdzv_conf or "keep_alive_max_attempt=60"]
    for flag, value in (
        ("--log-dir", args.log_dir),
        ("--log-prefix", args.log_prefix),
        ("--hang-timeout", args.hang_timeout),
    ):
        if value is not None:
            child += [flag, str(value)]
    child += (["-m"] if args.module else []) + [args.script, *args.script_args]
    return run_groups(options, child, log_dir=args.log_dir)


def _main(args: argparse.Namespace) -> int:
    if args.ft_replicas is not None or args.ft_replica_id is not None:
        if args.ft_replicas is None:
            raise LaunchError(
                "--ft-replica-id needs --ft-replicas R (how many groups the job has)", hint="e.g. --ft-replicas 2"
            )
        code = _ft_main(args)
        if code is not None:
            return code
    if args.rdzv_store and not (args.hostfile or args.hosts):
        raise LaunchError(
            "--rdzv-store needs --hostfile or --hosts",
            hint="on one node, use --rdzv-endpoint HOST:PORT --rdzv-conf is_host=0 of a running 'shardwise rendezvous'",
        )
    if args.hostfile or args.hosts:  # every node from here, over ssh
        from shardwise.launch.multihost import launch_on_hosts

        hang_timeout_env(args.hang_timeout)  # refuses a negative one here, before any host is asked
        options = options_from_args(args, args.script, args.script_args, args.module)
        return launch_on_hosts(options, host_launch_from_args(args, args.hang_timeout))
    if args.stop_with_stdin:  # the remote half: this node stops when its ssh session ends
        from shardwise.launch.lifeline import stop_with_stdin

        stop_with_stdin()
    from shardwise.launch.forward import forward_for_this_process
    from shardwise.launch.run import run_launch  # torch's elastic agent: only when launching
    from shardwise.launch.worker_main import line_buffered_output

    line_buffered_output()  # the lines torch's agent copies from the workers' files leave whole and on time
    _check_flags(args)
    hang_env = hang_timeout_env(args.hang_timeout)
    forwarded = forward_for_this_process()  # SIGUSR1 (Slurm's warning) never kills the launcher
    resolved = resolve(options_from_args(args, args.script, args.script_args, args.module))
    run_launch(dataclasses.replace(resolved, worker_env={**resolved.worker_env, **hang_env}), forwarded=forwarded)
    return 0
