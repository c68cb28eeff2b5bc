"""The job step of an sbatch script with fault-tolerant replica groups (``shardwise slurm --ft-replicas R``).

The allocation's ``N`` nodes (``N`` divisible by ``R``) split in node-list order into ``R`` groups
of ``G = N/R``:

1. the batch script runs on the allocation's first node; it starts torchft's lighthouse there in
   the background (``shardwise lighthouse --port P``, no job step, so it takes no task's CPUs or
   GPUs) and waits until the port answers;
2. one ``srun --nodes=G --ntasks=G --relative=r*G`` per group, in the background: one
   ``shardwise run --ft-replica-id r --lighthouse FIRST:P`` task per node of the group, with its
   own c10d rendezvous (at the group's first node, port ``rdzv_port + r``, id
   ``$SLURM_JOB_ID-ft<r>``) and its own ``--max-restarts``; ``--kill-on-bad-exit`` ends that
   group's step only, the others keep stepping (:mod:`shardwise.train.ft`);
3. SIGUSR1 (the time-limit warning) and SIGTERM go to every group's ``srun``, as in
   :mod:`shardwise.launch.sbatch_step`;
4. once every group has ended the lighthouse is stopped; the job's exit code is 0 when any group
   finished (the others were lost), else the first group's failure, and a job stopped by the
   warning is requeued.
"""

from __future__ import annotations

from shardwise.errors import ShardwiseError
from shardwise.launch.sbatch_step import USR1_EXIT

READY_S = 60  # how long the script waits for the lighthouse to listen


def check_groups(nodes: int, replicas: int) -> int:
    """Nodes per group; refuses a count the replicas do not divide."""
    if replicas < 1:
        raise ShardwiseError(f"--ft-replicas {replicas} must be at least 1", hint="e.g. --ft-replicas 2")
    if nodes % replicas:
        raise ShardwiseError(f"--ft-replicas {replicas} does not divide --nodes {nodes}",
                             hint=f"ask for a multiple of {replicas} nodes (every group gets the same number)")
    return nodes // replicas


def ft_step_lines(run_args: str, target: str, *, nodes: int, replicas: int, min_replicas: int, lighthouse_port: int,
                  rdzv_port: int, requeue: bool) -> list[str]:
    """The lighthouse, one ``srun`` per group and the traps (see the module doc). ``run_args`` are
    the ``shardwise run`` flags every node shares, ``target`` the quoted script and its arguments."""
    size = check_groups(nodes, replicas)
    if not 1 <= min_replicas <= replicas:
        raise ShardwiseError(
            f"--ft-min-replicas {min_replicas} is outside 1..{replicas}", hint="e.g. --ft-min-replicas 1"
        )
    for flag, port in (("--lighthouse-port", lighthouse_port), ("--rdzv-port", rdzv_port)):
        if not 0 < port < 65536 - replicas:
            raise ShardwiseError(f"{flag} {port} is not a port", hint="use 1024-65000, e.g. 29510")
    lines = [
        "set -uo pipefail",
        "nodes=($(scontrol show hostnames \"$SLURM_JOB_NODELIST\"))",
        "lighthouse_host=\"${nodes[0]}\"  # this script runs on the allocation's first node",
        "# torchft's lighthouse: every group meets it at each step; here, outside any job step.",
        f"shardwise lighthouse --port {lighthouse_port} --min-replicas {min_replicas} &",
        "lighthouse=$!",
        f"for _ in $(seq {READY_S}); do",
        f"  (exec 3<>\"/dev/tcp/$lighthouse_host/{lighthouse_port}\") 2>/dev/null && break",
        "  kill -0 \"$lighthouse\" 2>/dev/null || { echo \"shardwise: the lighthouse did not start\" >&2; exit 1; }",
        "  sleep 1",
        "done",
        "steps=()",
        "warned=0",
        "# SIGUSR1 (the time-limit warning) and SIGTERM go on to every group's srun, which relays them.",
        "pass_on() { for s in \"${steps[@]}\"; do kill -\"$1\" \"$s\" 2>/dev/null; done; return 0; }",
        "trap 'warned=1; echo \"shardwise: SIGUSR1 (time-limit warning): the workers checkpoint and stop\" >&2; "
        "pass_on USR1' USR1",
        "trap 'echo \"shardwise: SIGTERM: passing it on to every group\" >&2; pass_on TERM' TERM",
    ]
    for r in range(replicas):
        lines += [
            f"# replica group {r}: nodes {r * size}..{(r + 1) * size - 1}, its own rendezvous",
            f"srun --nodes={size} --ntasks={size} --ntasks-per-node=1 --relative={r * size} --kill-on-bad-exit=1 "
            f"shardwise run {run_args} --ft-replicas {replicas} --ft-replica-id {r} --lighthouse "
            f"\"$lighthouse_host:{lighthouse_port}\" --ft-min-replicas {min_replicas} --rdzv-backend c10d "
            f"--rdzv-endpoint \"${{nodes[{r * size}]}}:{rdzv_port + r}\" --rdzv-id \"$SLURM_JOB_ID-ft{r}\" {target} &",
            "steps+=($!)",
        ]
    lines += [
        "# wait returns early (128 + signal) when a trapped signal arrives: wait again until each group has",
        "# ended; the job succeeds when any group finished, else it fails with the first group's exit code.",
        "ok=0; rc=0",
        "for s in \"${steps[@]}\"; do",
        "  wait \"$s\"",
        "  while kill -0 \"$s\" 2>/dev/null; do wait \"$s\"; done",
        "  wait \"$s\"; code=$?",
        "  if [ \"$code\" -eq 0 ]; then ok=1; elif [ \"$rc\" -eq 0 ]; then rc=$code; fi",
        "done",
        "[ \"$ok\" -eq 1 ] && rc=0",
        "kill -TERM \"$lighthouse\" 2>/dev/null; wait \"$lighthouse\"",
    ]
    if requeue:
        lines += [
            f"if [ \"$rc\" -eq {USR1_EXIT} ] || {{ [ \"$warned\" -eq 1 ] && [ \"$rc\" -ne 0 ]; }}; then",
            "  echo \"shardwise: the groups stopped before the end (exit $rc); requeueing job $SLURM_JOB_ID\" >&2",
            "  scontrol requeue \"$SLURM_JOB_ID\"",
            "fi",
        ]
    return lines + ["exit \"$rc\""]
