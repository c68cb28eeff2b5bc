"""The part of an sbatch script that runs the job step and carries Slurm's signals to it.

Slurm warns a job before its time limit with the signal of ``--signal``. ``B:USR1@120`` sends
SIGUSR1 to the batch shell only, 120 s before the end; a shell without a trap dies of it, and the
workers never learn. Here the shell traps it and passes it on:

1. ``srun`` runs in the background (bash runs a trap only between commands, so a foreground
   ``srun`` would hold the warning until the step had ended) and the shell ``wait``\\ s for it;
2. the USR1 trap sends SIGUSR1 to ``srun``, which relays it to its tasks (``shardwise run`` on each
   node), which pass it to their workers; the workers save a checkpoint at their next step and
   exit, and ``shardwise run`` exits with 138 (128 + SIGUSR1);
3. a TERM (``scancel``, the time limit itself) is passed on the same way (Slurm signals the step
   too; a pre-emption request is a flag, so twice is harmless);
4. ``wait`` returns early when a trapped signal arrives, so the shell waits again until the step
   has really ended (a last ``wait`` gives its own exit status, which bash keeps), then, if the step stopped on the
   warning (exit 138, or any non-zero exit after a warning), requeues the job with ``scontrol requeue``: it starts again
   later and resumes from the checkpoint (the training command must resume, e.g. ``--checkpoint.resume=auto``).

``#SBATCH --requeue`` also lets Slurm itself requeue the job after a pre-emption or a node failure.
A job step signalled directly (``--signal=USR1@N`` without ``B:``) works too: the step exits 138
and the script requeues.
"""

from __future__ import annotations

USR1_EXIT = 138  # 128 + SIGUSR1: what `shardwise run` exits with after a SIGUSR1 stop


def header_lines(*, warning_s: int, requeue: bool) -> list[str]:
    """The ``#SBATCH`` lines for the warning and the requeue."""
    lines = [
        f"#SBATCH --signal=B:USR1@{warning_s}   # time-limit warning to this script, which passes it to the job step"
    ]
    if requeue:
        lines += ["#SBATCH --requeue               # a pre-empted or requeued job starts again and resumes",
                  "#SBATCH --open-mode=append      # and appends to the same output file"]
    return lines


def step_lines(command: str, *, requeue: bool) -> list[str]:
    """Run ``command`` (an ``srun ...`` line) as the job step, with the traps described above."""
    lines = [
        "set -uo pipefail",
        "step=''",
        "warned=0",
        "# SIGUSR1 (the time-limit warning) and SIGTERM go on to every task of the step: srun relays them.",
        "pass_on() { [ -n \"$step\" ] && kill -\"$1\" \"$step\" 2>/dev/null; return 0; }",
        "trap 'warned=1; echo \"shardwise: SIGUSR1 (time-limit warning): the workers checkpoint and stop\" >&2; "
        "pass_on USR1' USR1",
        "trap 'echo \"shardwise: SIGTERM: passing it on to the job step\" >&2; pass_on TERM' TERM",
        "# shardwise run reads node count, node rank and the master host from Slurm.",
        f"{command} &",
        "step=$!",
        "# wait returns early (128 + signal) when a trapped signal arrives: wait again until the step has",
        "# ended; then wait once more, which gives the step's own exit status (bash keeps it).",
        "wait \"$step\"",
        "while kill -0 \"$step\" 2>/dev/null; do wait \"$step\"; done",
        "wait \"$step\"; rc=$?",
    ]
    if requeue:
        lines += [
            f"# {USR1_EXIT} = 128 + SIGUSR1: the workers saved a checkpoint and stopped; run again later to resume.",
            f"if [ \"$rc\" -eq {USR1_EXIT} ] || {{ [ \"$warned\" -eq 1 ] && [ \"$rc\" -ne 0 ]; }}; then",
            "  echo \"shardwise: the job step stopped before the end (exit $rc); requeueing job $SLURM_JOB_ID\" >&2",
            "  scontrol requeue \"$SLURM_JOB_ID\"",
            "fi",
        ]
    lines.append("exit \"$rc\"")
    return lines
