"""Write an sbatch script that starts a job with ``shardwise run`` on every node of an allocation.

One Slurm task per node runs ``shardwise run``; it reads the node count, node rank and master
(the first host of the node list) from Slurm and starts one process per GPU itself. The
time-limit warning reaches the workers and a job stopped by it is requeued
(:mod:`shardwise.launch.sbatch_step`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from shardwise.errors import ShardwiseError
from shardwise.launch.sbatch_ft import ft_step_lines
from shardwise.launch.sbatch_step import header_lines, step_lines

# Every form `sbatch --time` accepts; the first field of each is unbounded, the others are clock fields.
_TIME_FORMS = tuple(re.compile(form, re.ASCII) for form in (
    r"(?P<m>[0-9]+)",
    r"(?P<m>[0-9]+):(?P<s>[0-9]{1,2})",
    r"(?P<h>[0-9]+):(?P<m>[0-9]{1,2}):(?P<s>[0-9]{1,2})",
    r"(?P<d>[0-9]+)-(?P<h>[0-9]{1,2})",
    r"(?P<d>[0-9]+)-(?P<h>[0-9]{1,2}):(?P<m>[0-9]{1,2})",
    r"(?P<d>[0-9]+)-(?P<h>[0-9]{1,2}):(?P<m>[0-9]{1,2}):(?P<s>[0-9]{1,2})",
))
_CLOCK_LIMITS = {"h": 23, "m": 59, "s": 59}
WARNING_S = 120  # SIGUSR1 this long before the limit: time to write a checkpoint
_NAME = re.compile(r"\S+")


@dataclass(frozen=True)
class SbatchSpec:
    script: tuple[str, ...]
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_task: int | None = None
    time: str = "24:00:00"
    job_name: str = "shardwise"
    partition: str | None = None
    account: str | None = None
    output: str = "slurm-%j.out"
    max_restarts: int = 0
    warning_s: int = WARNING_S  # seconds before the time limit that SIGUSR1 is sent
    requeue: bool = True
    ft_replicas: int | None = None  # fault-tolerant replica groups (shardwise.launch.sbatch_ft)
    ft_min_replicas: int = 1
    lighthouse_port: int = 29510
    rdzv_port: int = 29400  # group r's rendezvous at its first node, this port + r


def slurm_time_seconds(text: str) -> int:
    """The limit of a ``--time`` value in seconds (0: Slurm's "no limit"), in any form sbatch
    accepts: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
    days-hours:minutes:seconds. Raises :class:`ShardwiseError` for anything else."""
    for form in _TIME_FORMS:
        match = form.fullmatch(text)
        if match is None:
            continue
        fields = {key: int(value) for key, value in match.groupdict().items()}
        leading = next(iter(fields))
        if all(value <= _CLOCK_LIMITS[key] for key, value in fields.items() if key not in ("d", leading)):
            d, h, m, sec = (fields.get(key, 0) for key in "dhms")
            return ((d * 24 + h) * 60 + m) * 60 + sec
    raise ShardwiseError(
        f"--time {text!r} is not a Slurm time",
        hint="use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. 120, 24:00:00 or 2-00:00:00",
    )


def warning_seconds(limit_s: int, wanted_s: int = WARNING_S) -> int:
    """How long before the limit Slurm sends SIGUSR1: ``wanted_s`` (``--warning``, two minutes by
    default), or half the limit when that is shorter, so the warning always comes before the end
    (Slurm rounds a limit up to whole minutes)."""
    if limit_s == 0:  # no limit
        return wanted_s
    return min(wanted_s, -(-limit_s // 60) * 60 // 2)


def _check_names(spec: SbatchSpec) -> None:
    """A name with whitespace or a newline would end its ``#SBATCH`` line early or start a new line
    of the script."""
    for flag, value in (("--job-name", spec.job_name), ("--partition", spec.partition), ("--account", spec.account)):
        if value is not None and not _NAME.fullmatch(value):
            raise ShardwiseError(
                f"{flag} {value!r} is empty or contains whitespace", hint="use letters, digits, '-' or '_'"
            )


def render_sbatch(spec: SbatchSpec) -> str:
    """The sbatch script text; raises :class:`ShardwiseError` on impossible values."""
    if spec.nodes < 1:
        raise ShardwiseError(f"--nodes {spec.nodes} must be at least 1", hint="for example --nodes 2")
    if spec.gpus_per_node < 0:
        raise ShardwiseError(f"--gpus-per-node {spec.gpus_per_node} is negative", hint="use 0 for CPU-only nodes")
    if spec.cpus_per_task is not None and spec.cpus_per_task < 1:
        raise ShardwiseError(
            f"--cpus-per-task {spec.cpus_per_task} must be at least 1", hint="omit it to use Slurm's default"
        )
    if spec.max_restarts < 0:
        raise ShardwiseError(f"--max-restarts {spec.max_restarts} is negative", hint="use 0 or more")
    if spec.warning_s < 1:
        raise ShardwiseError(f"--warning {spec.warning_s} must be at least 1 second", hint="e.g. --warning 120")
    warning = warning_seconds(slurm_time_seconds(spec.time), spec.warning_s)
    _check_names(spec)
    if not spec.script:
        raise ShardwiseError("no script to run", hint="put it after '--': shardwise slurm --nodes 2 -- train.py")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={spec.time}",
        f"#SBATCH --output={spec.output}",
    ]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    if spec.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={spec.cpus_per_task}")
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.account:
        lines.append(f"#SBATCH --account={spec.account}")
    nproc = str(spec.gpus_per_node) if spec.gpus_per_node else "auto"
    target = " ".join(shlex.quote(part) for part in spec.script)
    lines += header_lines(warning_s=warning, requeue=spec.requeue) + [""]
    if spec.ft_replicas is not None:
        lines += ft_step_lines(
            f"--nproc-per-node {nproc} --max-restarts {spec.max_restarts}",
            target,
            nodes=spec.nodes,
            replicas=spec.ft_replicas,
            min_replicas=spec.ft_min_replicas,
            lighthouse_port=spec.lighthouse_port,
            rdzv_port=spec.rdzv_port,
            requeue=spec.requeue,
        ) + [""]
        return "\n".join(lines)
    command = (f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 shardwise run --nproc-per-node {nproc} "
               f"--max-restarts {spec.max_restarts} {target}")
    lines += step_lines(command, requeue=spec.requeue) + [""]
    return "\n".join(lines)
