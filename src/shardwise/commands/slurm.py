"""``shardwise slurm``: print or write an sbatch script that uses ``shardwise run``."""

from __future__ import annotations

import argparse

from shardwise.config import check_output_file
from shardwise.launch.sbatch import SbatchSpec, render_sbatch

EXAMPLES = """examples:
  shardwise slurm --nodes 2 --gpus-per-node 8 --time 24:00:00 -- train.py --lr 3e-4
  shardwise slurm --nodes 4 --partition gpu --out job.sbatch -- train.py && sbatch job.sbatch
  shardwise slurm --nodes 2 --warning 300 -- -m shardwise.jobs.train --config run.toml --checkpoint.resume=auto
  # fault-tolerant replica groups (shardwise[ft]): 4 nodes, 2 groups of 2, the lighthouse on the first node:
  shardwise slurm --nodes 4 --ft-replicas 2 --max-restarts 3 -- train.py

The script asks Slurm for SIGUSR1 --warning seconds before the time limit and passes it to the
workers, which save a checkpoint and stop; then it requeues the job, which resumes when it runs again.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slurm", help="write an sbatch script for a multi-node job", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--cpus-per-task", type=int, default=None)
    p.add_argument(
        "--time",
        default="24:00:00",
        help="wall-clock limit in any sbatch form: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS",
    )
    p.add_argument("--job-name", default="shardwise")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--warning", type=int, default=120, metavar="SECONDS",
                   help="send SIGUSR1 this long before the time limit: the workers checkpoint and stop (default 120)")
    p.add_argument("--no-requeue", action="store_true",
                   help="do not requeue the job when the warning stopped it (default: requeue, and #SBATCH --requeue)")
    p.add_argument(
        "--ft-replicas",
        type=int,
        default=None,
        metavar="R",
        help="R fault-tolerant replica groups over the nodes (nodes divisible by R), each with its own rendezvous "
        "and restarts; torchft's lighthouse on the first node (docs/multinode.md)",
    )
    p.add_argument(
        "--ft-min-replicas",
        type=int,
        default=1,
        metavar="K",
        help="fewest live groups that may commit a step (default 1)",
    )
    p.add_argument(
        "--lighthouse-port",
        type=int,
        default=29510,
        help="the lighthouse's port on the first node (default %(default)s)",
    )
    p.add_argument(
        "--rdzv-port",
        type=int,
        default=29400,
        help="group r's rendezvous port on its first node is this + r (default %(default)s)",
    )
    p.add_argument("--out", default=None, help="write the script here instead of printing it")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- then the script and its arguments")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    script = args.script[1:] if args.script[:1] == ["--"] else list(args.script)
    text = render_sbatch(SbatchSpec(
        script=tuple(script), nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
        time=args.time, job_name=args.job_name, partition=args.partition, account=args.account,
        max_restarts=args.max_restarts, warning_s=args.warning, requeue=not args.no_requeue,
        ft_replicas=args.ft_replicas, ft_min_replicas=args.ft_min_replicas, lighthouse_port=args.lighthouse_port,
        rdzv_port=args.rdzv_port,
    ))
    if args.out:
        check_output_file(args.out, option="--out")
        with open(args.out, "w") as fh:
            fh.write(text)
        print(f"wrote {args.out}; submit it with: sbatch {args.out}")
    else:
        print(text, end="")
    return 0
