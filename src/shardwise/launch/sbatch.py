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
from shardwise.launch.sbatch_step import header_lines, step_lines

_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


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
    warning_s: int = 120  # seconds before the time limit that SIGUSR1 is sent
    requeue: bool = True


def render_sbatch(spec: SbatchSpec) -> str:
    """The sbatch script text; raises :class:`ShardwiseError` on impossible values."""
    if spec.nodes < 1:
        raise ShardwiseError(f"--nodes {spec.nodes} must be at least 1", hint="for example --nodes 2")
    if spec.gpus_per_node < 0:
        raise ShardwiseError(f"--gpus-per-node {spec.gpus_per_node} is negative", hint="use 0 for CPU-only nodes")
    if not _TIME.match(spec.time):
        raise ShardwiseError(f"--time {spec.time!r} is not a Slurm time", hint="use HH:MM:SS or D-HH:MM:SS")
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
    if spec.warning_s < 1:
        raise ShardwiseError(f"--warning {spec.warning_s} must be at least 1 second", hint="e.g. --warning 120")
    command = (f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 shardwise run --nproc-per-node {nproc} "
               f"--max-restarts {spec.max_restarts} {target}")
    lines += header_lines(warning_s=spec.warning_s, requeue=spec.requeue) + [""]
    lines += step_lines(command, requeue=spec.requeue) + [""]
    return "\n".join(lines)
