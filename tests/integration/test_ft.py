"""Fault-tolerant replica groups (``shardwise run --ft-replicas``, torchft) end to end, with real
processes on loopback: parity with plain data parallelism, a group killed mid-step that restarts and
heals while the survivor keeps its process and its steps, and the lighthouse lost."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchft", reason="needs shardwise[ft] (torchft)")

from tests.integration import ft_harness as h  # noqa: E402

SHARDWISE = [sys.executable, "-m", "shardwise"]


def _plain(work: Path, *, nproc: int, plan: str, steps: int) -> dict:
    out = work / "plain"
    proc = subprocess.run(
        SHARDWISE + ["run", "--nproc-per-node", str(nproc), str(h.SCRIPT), str(out), plan, str(steps)],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "replica0.pt", weights_only=False)


def _assert_parity(ft: dict[int, dict], plain: dict) -> None:
    for r, got in ft.items():
        assert got["step"] == plain["step"] and got["position"] == plain["position"] and got["lr"] == plain["lr"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-6)
        for name, value in plain["weights"].items():
            torch.testing.assert_close(got["weights"][name], value, rtol=1e-5, atol=1e-6, msg=f"replica {r}: {name}")
    first = ft[0]["weights"]
    assert all(
        torch.equal(first[k], other["weights"][k]) for other in ft.values() for k in first
    )  # bitwise across groups


@pytest.mark.slow_allowed(
    seconds=150, why="two launches (a 2-group job and the plain dp=2 job it must equal), each a few Python starts"
)
def test_two_replica_groups_equal_plain_dp2(tmp_path: Path) -> None:
    """No failure: 2 groups of 1 process (token-weighted cross-group mean, ragged masks, a step LR
    schedule) train exactly as dp=2 on one world; group 0 writes the checkpoint."""
    job = h.start(tmp_path, replicas=2, nproc=1, plan="dp", steps=4, sleep_s=0.0, min_replicas=2,
                  env={"FT_CHECKPOINT": str(tmp_path / "ckpt")})
    assert job.finish(180) == 0, "".join(job.lines[-40:])
    _assert_parity(h.results(job), _plain(tmp_path, nproc=2, plan="dp", steps=4))
    summary = h.summarize_file(job)
    assert summary["committed_steps"] == 4 and summary["discarded_steps"] == 0 and summary["healed_replicas"] == 0
    assert (tmp_path / "ckpt" / "step_00000004" / "COMMITTED.json").exists()


@pytest.mark.slow
@pytest.mark.slow_allowed(
    seconds=200, why="HSDP: 2 groups x 2 processes of ZeRO-3 against 4 processes of dp=2,zero=3,shard=2"
)
def test_zero3_inside_groups_equals_hsdp(tmp_path: Path) -> None:
    job = h.start(tmp_path, replicas=2, nproc=2, plan="zero=3", steps=3, sleep_s=0.0, min_replicas=2)
    assert job.finish(200) == 0, "".join(job.lines[-40:])
    _assert_parity(h.results(job), _plain(tmp_path, nproc=4, plan="dp=2,zero=3,shard=2", steps=3))


@pytest.mark.slow_allowed(
    seconds=180, why="a group is killed mid-step, restarts (a new Python process) and heals while the other trains on"
)
@pytest.mark.fresh_workers  # a worker is killed, and the survivors' process identity (PIDs) is checked
def test_group_killed_mid_step_restarts_and_heals(tmp_path: Path) -> None:
    """Group 1's worker SIGKILLs itself after its backward of step 6 (or the first after it that
    both groups are in: the first to start trains alone until the other joins), while group 0 waits in the
    gradient all-reduce: group 0 discards that step and trains on alone, in the same process, its
    committed steps only growing; group 1 restarts (--max-restarts 1), heals from group 0 and
    both end with bitwise equal weights, step, data position and learning rate. The steps wait 0.3 s
    each (the survivor's 54 steps alone outlast group 1's restart) until both groups are together
    again; the steps after that run at full speed."""
    job = h.start(tmp_path, replicas=2, nproc=1, plan="dp", steps=60, sleep_s=0.3, max_restarts=1, kill="1:6",
                  env={"FT_FAST_WHEN_WHOLE": "1"})
    assert job.finish(200) == 0, "".join(job.lines[-60:])
    survivor = [s for s in job.steps if s.replica == 0]
    assert len({s.pid for s in survivor}) == 1, "the survivor restarted"
    assert [s.step for s in survivor] == list(range(survivor[0].step, 61)), (
        "the survivor's committed steps went back or skipped"
    )
    assert len({s.pid for s in job.steps if s.replica == 1}) == 2, "the killed group did not restart"
    summary = h.summarize_file(job)
    assert summary["discarded_steps"] >= 1 and summary["groups"]["1"]["heals"] >= 1, summary
    assert summary["groups"]["0"]["samples_skipped"] > 0  # group 1's shares while it was gone
    final = h.results(job)
    assert final[0]["step"] == final[1]["step"] == 60 and final[0]["position"] == final[1]["position"]
    assert final[0]["lr"] == final[1]["lr"]
    assert all(torch.equal(final[0]["weights"][k], final[1]["weights"][k]) for k in final[0]["weights"])
    assert not [s.pid for s in job.steps if h.alive(s.pid)] and not h.session_processes(job.proc.pid)
    assert any("discarded" in line and "running it again" in line for line in job.lines)
    assert any("left [1]" in line for line in job.lines) and any("joined [1]" in line for line in job.lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow_allowed(
    seconds=120, why="a lighthouse process, a training group, and the quorum timeout it must run into"
)
def test_lost_lighthouse_exits_with_one_line(tmp_path: Path) -> None:
    port = _free_port()
    lighthouse = subprocess.Popen(SHARDWISE + ["lighthouse", "--port", str(port)], stdout=subprocess.PIPE, text=True,
                                  start_new_session=True)
    try:
        assert "serving torchft's quorum" in (lighthouse.stdout.readline() if lighthouse.stdout else "")
        job = h.start(
            tmp_path,
            replicas=1,
            nproc=1,
            plan="dp",
            steps=500,
            sleep_s=0.05,
            extra=[
                "--ft-replica-id",
                "0",
                "--lighthouse",
                f"127.0.0.1:{port}",
                "--ft-quorum-timeout",
                "5",
                "--ft-timeout",
                "5",
            ],
        )
        job.wait_for(0, 3, 120)
    finally:
        os.killpg(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait()
    killed = time.monotonic()
    assert job.finish(60) == 2
    assert time.monotonic() - killed < 40
    errors = [line for line in job.lines if "error:" in line]
    assert len(errors) == 1 and "the lighthouse at http://127.0.0.1" in errors[0] and "does not answer" in errors[0], (
        job.lines[-10:]
    )
    assert not [s.pid for s in job.steps if h.alive(s.pid)]


@pytest.mark.slow_allowed(
    seconds=150, why="two groups start, one dies for good, and the other must run into its quorum timeout"
)
def test_below_min_replicas_exits_with_one_line(tmp_path: Path) -> None:
    """--ft-min-replicas 2 and group 1 dies without a restart: group 0 discards the step and, with
    no quorum of 2 within --ft-quorum-timeout, exits with one line naming the cause; nothing hangs."""
    job = h.start(tmp_path, replicas=2, nproc=1, plan="dp", steps=200, sleep_s=0.2, min_replicas=2, kill="1:3",
                  extra=["--ft-quorum-timeout", "5"])
    code = job.finish(150)
    assert code != 0
    errors = [line for line in job.lines if "no quorum for step" in line]
    assert len(errors) == 1 and "fewer than 2 replica group(s) (--ft-min-replicas) are alive" in errors[0], job.lines[
        -10:
    ]
    assert not [s.pid for s in job.steps if h.alive(s.pid)] and not h.session_processes(job.proc.pid)
