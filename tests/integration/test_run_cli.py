"""``shardwise run`` / ``launch`` / ``doctor`` / ``slurm`` end to end, with real processes.

The launchers (``python -m shardwise ...``) and the scripts run as ``python SCRIPT`` fork from the
session's fork server (:func:`tests.worker_forkserver.python`: the same pipes, environment,
signals and exit status, without 1.5-2 CPU-seconds of imports each), except where the check is
about the entry point itself: the whole stderr of a launch that fails in its workers (nothing else
printed at start-up, ``run`` and ``verify``), ``--help``; and where a new interpreter costs less
(``slurm`` and what the argument parser refuses import no torch) through ``SHARDWISE``."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardwise
from tests.worker_forkserver import python

SCRIPTS = Path(__file__).parent / "scripts"
SHARDWISE = [sys.executable, "-m", "shardwise"]  # a new interpreter


def _shardwise() -> list[str]:
    """``python -m shardwise``, forked from the session's fork server when it runs."""
    return python("-m", "shardwise")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def _worlds(output: str) -> list[dict[str, str]]:
    return [dict(kv.split("=") for kv in m.split()) for m in re.findall(r"WORLD (.*?sum=\d+)", output)]


def test_run_forms_world_of_four() -> None:
    proc = _run(_shardwise() + ["run", "--nproc-per-node", "4", str(SCRIPTS / "report_world.py")])
    assert proc.returncode == 0, proc.stderr
    worlds = _worlds(proc.stdout)
    assert sorted(int(w["rank"]) for w in worlds) == [0, 1, 2, 3]
    assert all(w["world"] == "4" and w["sum"] == "10" and w["launcher"] == "torchrun" for w in worlds)


def test_two_nodes_on_loopback_form_one_world() -> None:
    port = _free_port()
    common = ["run", "--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--rdzv-timeout", "60"]
    nodes = [subprocess.Popen(_shardwise() + common + ["--node-rank", str(r), str(SCRIPTS / "report_world.py")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    worlds = _worlds(outs[0][0] + outs[1][0])
    assert sorted(int(w["rank"]) for w in worlds) == [0, 1, 2, 3]
    assert {w["node"] for w in worlds} == {"0", "1"}
    assert all(w["world"] == "4" and w["sum"] == "10" for w in worlds)


def test_restart_recovers_and_no_restart_fails_visibly() -> None:
    script = str(SCRIPTS / "fail_first_attempt.py")
    ok = _run(_shardwise() + ["run", "--nproc-per-node", "2", "--max-restarts", "1", script])
    assert ok.returncode == 0, ok.stderr
    assert sorted(re.findall(r"OK rank=(\d) attempt=1", ok.stdout)) == ["0", "1"]
    bad = _run(_shardwise() + ["run", "--nproc-per-node", "2", "--max-restarts", "0", script])
    assert bad.returncode != 0
    assert "RuntimeError: injected failure on rank 1, attempt 0" in bad.stderr  # the failing rank's own error
    assert bad.stderr.count("Traceback") == 1, bad.stderr  # shown once
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("shardwise run: error: rank 1 ") and "exit code 1" in last


def test_an_error_raised_by_shardwise_in_every_worker_is_one_line_and_exit_2() -> None:
    """Bad input refused inside the workers reads as a check made before launch: its one line,
    once, with the ranks that raised it (shardwise.launch.worker_errors). New interpreters: their
    whole stderr is that line, nothing printed at start-up either."""
    proc = _run(SHARDWISE + ["run", "--nproc-per-node", "2", str(SCRIPTS / "refuse_on_every_rank.py")])
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert lines == [
        "shardwise run: error: cp=2: an attention call has a mask or is not causal; drop cp (raised on ranks 0, 1)"
    ], proc.stderr
    # the same through shardwise.launch(fn) (verify's workers), where the check needs the model's forward
    proc = _run(SHARDWISE + ["verify", "--plan", "cp=2", "--steps", "1", "--loss-reduction", "samples",
                             "--script", str(SCRIPTS / "cp_masked_attention.py")], timeout=180)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "shardwise verify: error: cp=2: an attention call has a mask or is not causal"
    ), lines
    assert lines[0].endswith("(raised on ranks 0, 1)"), lines


@pytest.mark.parametrize(
    ("args", "pattern", "code"),
    [
        (["run", "--bogus", "x.py"], r"unrecognized arguments: --bogus", 2),
        (["run", "missing_script.py"], r"script 'missing_script.py' does not exist", 1),
        (["run", "--nproc-per-node", "0", "SCRIPT"], r"--nproc-per-node 0 must be at least 1", 1),
        (
            [
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                "PORT",
                "--rdzv-timeout",
                "2",
                "SCRIPT",
            ],
            r"node 0 at 127.0.0.1:\d+ did not answer within 2s",
            1,
        ),
        (
            ["run", "--nnodes", "2", "--master-addr", "no-such-host.invalid", "--master-port", "PORT", "SCRIPT"],
            r"does not resolve",
            1,
        ),
        (
            [
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                "0",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                "BUSY",
                "SCRIPT",
            ],
            r"already in use",
            1,
        ),
        (["slurm", "--nodes", "2", "--time", "forever", "--", "t.py"], r"is not a Slurm time", 2),
        (["nonsense"], r"invalid choice: 'nonsense'", 2),
    ],
)
def test_bad_input_is_one_line(args: list[str], pattern: str, code: int) -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        args = [a.replace("SCRIPT", str(SCRIPTS / "report_world.py")).replace("PORT", str(_free_port()))
                .replace("BUSY", str(busy.getsockname()[1])) for a in args]
        start = time.monotonic()
        command = SHARDWISE if code == 2 else _shardwise()  # 2: the argument parser's, before torch is imported
        proc = _run(command + args, timeout=60)
    assert proc.returncode == code, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 30


def _env_without_launchers() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
    }


@pytest.mark.parametrize("launcher", ["openmpi", "mpich", "slurm"])
def test_init_under_mpi_and_slurm_variables(launcher: str) -> None:
    """What mpirun or srun would set, for 2 local ranks: shardwise.init() forms the world from it."""
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = _env_without_launchers()
        env["MASTER_PORT"] = port
        if launcher == "openmpi":
            env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
                       OMPI_COMM_WORLD_LOCAL_SIZE="2")
        elif launcher == "mpich":
            env.update(PMI_RANK=str(rank), PMI_SIZE="2", MPI_LOCALRANKID=str(rank), MPI_LOCALNRANKS="2")
        else:
            env.update(
                SLURM_PROCID=str(rank),
                SLURM_NTASKS="2",
                SLURM_LOCALID=str(rank),
                SLURM_NODEID="0",
                SLURM_NNODES="1",
                SLURM_STEP_ID="0",
                SLURM_JOB_ID="5",
                SLURM_STEP_NODELIST="localhost",
            )
        procs.append(subprocess.Popen(python(str(SCRIPTS / "report_world.py"), env=env), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    worlds = _worlds(outs[0][0] + outs[1][0])
    assert sorted(w["rank"] for w in worlds) == ["0", "1"]
    assert all(w["world"] == "2" and w["sum"] == "3" and w["launcher"] == launcher for w in worlds)


def test_plain_python_is_a_world_of_one() -> None:
    env = _env_without_launchers()
    proc = _run(python(str(SCRIPTS / "report_world.py"), env=env), env=env)
    assert proc.returncode == 0, proc.stderr
    assert _worlds(proc.stdout) == [
        {"rank": "0", "world": "1", "local": "0", "node": "0", "launcher": "none", "sum": "1"}
    ]


def _rank_and_sum(offset: int) -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), int(os.environ["LOCAL_WORLD_SIZE"]), t.item() + offset


def test_launch_runs_function_on_n_processes() -> None:
    assert shardwise.launch(_rank_and_sum, nprocs=2, args=(100,)) == [(0, 2, 101.0), (1, 2, 101.0)]


def test_doctor_passes_and_prints_table() -> None:
    proc = _run(_shardwise() + ["doctor", "--nproc", "2", "--max-size-mb", "1", "--iters", "3"])
    assert proc.returncode == 0, proc.stderr
    for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"):
        assert re.search(rf"{op}\s+ok", proc.stdout)
    assert "busbw (GB/s)" in proc.stdout and "all checks passed" in proc.stdout
    assert re.search(r"all_reduce\s+1 MiB\s+[\d.]+", proc.stdout)


def test_slurm_writes_an_sbatch_script(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    proc = _run(SHARDWISE + ["slurm", "--nodes", "2", "--gpus-per-node", "8", "--time", "24:00:00", "--out", str(out),
                             "--", "train.py", "--lr", "3e-4"])
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=24:00:00",
    ):
        assert line in text
    assert (
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 shardwise run --nproc-per-node 8 --max-restarts 0 train.py "
        "--lr 3e-4"
        in text
    )


def test_every_command_has_help_with_examples() -> None:
    import argparse

    from shardwise.cli import COMMANDS, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == sorted(m.rsplit(".", 1)[1] for m in COMMANDS)
    for name, command in sub.choices.items():
        assert "example" in command.format_help().lower(), name
    assert "example" in parser.format_help().lower()
    proc = _run(SHARDWISE + ["doctor", "--help"], timeout=60)  # and once through the real entry point
    assert proc.returncode == 0 and "shardwise doctor" in proc.stdout, proc.stderr


WHOLE = r"(LINE|ERR) rank=([0-3]) i=(\d+) " + " ".join(f"w{j}" for j in range(20)) + " end"


def test_every_line_of_every_rank_arrives_whole_with_and_without_a_prefix(tmp_path: Path) -> None:
    """4 ranks print 150 lines each to stdout and to stderr, every line in 23 pieces, with
    PYTHONUNBUFFERED=1 (under which `python -u` workers interleaved mid-line: about 1 line in 100
    of this script came out cut). Through the default path (the workers write to the launcher's
    stdout themselves) and through torch's agent (--log-prefix, --log-dir: per-rank files, lines
    copied behind the prefix), each of the 1,200 lines arrives whole, once."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    script, n = str(SCRIPTS / "print_lines.py"), 150
    plain = _run(_shardwise() + ["run", "--nproc-per-node", "4", script, str(n)], env=env)
    assert plain.returncode == 0, plain.stderr[-2000:]
    for stream, kind in ((plain.stdout, "LINE"), (plain.stderr, "ERR")):
        lines = [line for line in stream.splitlines() if line.startswith(("LINE", "ERR")) or "rank=" in line]
        assert all(re.fullmatch(WHOLE, line) for line in lines), [
            line for line in lines if not re.fullmatch(WHOLE, line)
        ][:3]
        got = sorted((int(m[2]), int(m[3])) for m in (re.fullmatch(WHOLE, line) for line in lines))
        assert got == [(r, i) for r in range(4) for i in range(n)] and {line.split()[0] for line in lines} == {kind}

    logs = tmp_path / "logs"
    kept = _run(
        _shardwise()
        + ["run", "--nproc-per-node", "4", "--log-prefix", "[${rank}]: ", "--log-dir", str(logs), script, str(n)],
        env=env,
    )
    assert kept.returncode == 0, kept.stderr[-2000:]
    for stream, kind in ((kept.stdout, "LINE"), (kept.stderr, "ERR")):
        lines = [line for line in stream.splitlines() if "rank=" in line]
        parsed = [re.fullmatch(r"\[([0-3])\]: " + WHOLE, line) for line in lines]
        assert all(parsed), [line for line, m in zip(lines, parsed) if not m][:3]
        assert all(m[1] == m[3] and m[2] == kind for m in parsed)  # each line behind its own rank
        assert len(lines) == 4 * n
    files = sorted(logs.glob("*/attempt_0/*/stdout.log"))
    assert len(files) == 4 and all(len(f.read_text().splitlines()) == n for f in files)
    assert all(
        f"rank={f.parent.name} " in f.read_text().splitlines()[0] for f in files
    )  # local rank = rank on one node
