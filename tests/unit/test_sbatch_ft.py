"""``shardwise slurm --ft-replicas R``: the written script, parsed, and run with stand-ins for
``scontrol``, ``srun`` and ``shardwise`` (no Slurm here): the lighthouse starts first and is stopped
last, every group has its id, the lighthouse address and its own rendezvous."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli import build_parser
from shardwise.errors import ShardwiseError
from shardwise.launch.sbatch import SbatchSpec, render_sbatch


def _groups(text: str) -> list[tuple[list[str], object]]:
    """Each group's srun flags and its ``shardwise run`` arguments as that command parses them."""
    out = []
    for line in text.splitlines():
        if line.startswith("srun "):
            words = shlex.split(line.rstrip(" &"))
            at = words.index("shardwise")
            out.append((words[1:at], build_parser().parse_args(words[at + 1:])))
    return out


def test_every_group_has_its_id_the_lighthouse_and_its_own_rendezvous() -> None:
    text = render_sbatch(SbatchSpec(script=("train.py", "--lr", "1"), nodes=6, gpus_per_node=4, max_restarts=3,
                                     ft_replicas=3, ft_min_replicas=2, lighthouse_port=29600))
    groups = _groups(text)
    assert len(groups) == 3
    for r, (srun, args) in enumerate(groups):
        assert (
            "--nodes=2" in srun
            and "--ntasks=2" in srun
            and f"--relative={2 * r}" in srun
            and "--kill-on-bad-exit=1" in srun
        )
        assert (args.ft_replicas, args.ft_replica_id, args.ft_min_replicas) == (3, r, 2)
        assert args.lighthouse == "$lighthouse_host:29600" and args.rdzv_backend == "c10d"
        assert (
            args.rdzv_endpoint == f"${{nodes[{2 * r}]}}:{29400 + r}" and args.nnodes is None
        )  # node count: the step's
        assert (args.nproc_per_node, args.max_restarts, args.script, args.script_args) == (
            "4",
            3,
            "train.py",
            ["--lr", "1"],
        )
    assert len({args.rdzv_id for _, args in groups}) == 3
    lines = text.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith("shardwise lighthouse --port 29600 --min-replicas 2 &")
    )
    stop = next(i for i, line in enumerate(lines) if line.startswith("kill -TERM \"$lighthouse\""))
    sruns = [i for i, line in enumerate(lines) if line.startswith("srun ")]
    assert start < min(sruns) and max(sruns) < stop


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        (SbatchSpec(script=("t.py",), nodes=3, ft_replicas=2), "--ft-replicas 2 does not divide --nodes 3"),
        (SbatchSpec(script=("t.py",), nodes=2, ft_replicas=0), "--ft-replicas 0 must be at least 1"),
        (
            SbatchSpec(script=("t.py",), nodes=2, ft_replicas=2, ft_min_replicas=3),
            "--ft-min-replicas 3 is outside 1..2",
        ),
        (
            SbatchSpec(script=("t.py",), nodes=2, ft_replicas=2, lighthouse_port=70000),
            "--lighthouse-port 70000 is not a port",
        ),
    ],
)
def test_bad_groups_are_one_line(spec: SbatchSpec, pattern: str) -> None:
    with pytest.raises(ShardwiseError, match=pattern):
        render_sbatch(spec)


FAKE_SHARDWISE = """#!/bin/bash
# stands in for 'shardwise lighthouse --port P': listens on P until SIGTERM
echo "lighthouse start $*" >> "$FAKE_LOG"
"$FAKE_PY" -c 'import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(); time.sleep(60)' "$3" &
py=$!
trap 'kill $py; echo "lighthouse stop" >> "$FAKE_LOG"; exit 0' TERM
wait
"""
FAKE_SRUN = """#!/bin/bash
# stands in for srun: records its command line; group 0 fails (its restarts spent), the others finish
echo "srun $*" >> "$FAKE_LOG"
sleep 0.5
case "$*" in *"--ft-replica-id 0 "*) exit 3;; esac
exit 0
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then printf 'localhost\\nnode1\\nnode2\\nnode3\\n'; else echo "scontrol $*" >> "$FAKE_LOG"; fi
"""


def test_the_script_runs_the_lighthouse_around_the_groups(tmp_path: Path) -> None:
    for name, body in (("shardwise", FAKE_SHARDWISE), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (tmp_path / name).write_text(body)
        (tmp_path / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(SbatchSpec(script=("train.py",), nodes=4, ft_replicas=2, lighthouse_port=port)))
    log = tmp_path / "log"
    env = {
        **os.environ,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "FAKE_PY": sys.executable,
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "localhost,node[1-3]",
    }
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    rows = log.read_text().splitlines()
    assert done.returncode == 0, done.stderr  # group 1 finished: the job did, though group 0 was lost
    assert rows[0] == f"lighthouse start lighthouse --port {port} --min-replicas 1" and rows[-1] == "lighthouse stop"
    sruns = sorted(row for row in rows if row.startswith("srun "))
    assert len(sruns) == 2 and not any(row.startswith("scontrol") for row in rows)  # no requeue without a warning
    assert [re.search(r"--rdzv-endpoint (\S+) --rdzv-id (\S+)", row).groups() for row in sruns] == [
        ("localhost:29400", "77-ft0"), ("node2:29401", "77-ft1")]
    assert all(f"--lighthouse localhost:{port}" in row for row in sruns)
