"""``shardwise run --hostfile`` and ``shardwise doctor --hosts`` end to end, through a real sshd on
loopback (the ``sshd`` fixture of tests/integration/conftest.py): the two "hosts" ``127.0.0.1``
and ``localhost`` are the same machine reached over two ssh names.

Where the check is not about stopping a launcher, the ``shardwise run`` of each host forks from the
session's fork server (``--python`` :func:`tests.worker_forkserver.python_wrapper`: it gets its ssh
session's stdin, stdout and stderr themselves), and so does this machine's launcher where it imports
torch (the rendezvous store, the lighthouse: :func:`tests.worker_forkserver.python`); the
tests of Ctrl-C and SIGKILL keep new interpreters everywhere, the default ``--python`` with them."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import LoopbackSshd, free_port
from tests.worker_forkserver import python, python_wrapper

# The first test of a fresh machine also installs openssh-server (apt-get, up to ~12 min worst case);
# every command below has its own hard timeout.
pytestmark = pytest.mark.timeout(900)

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]
SHARDWISE = [sys.executable, "-m", "shardwise"]


@pytest.fixture(scope="module")
def forked_python(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """``--python FILE``: each host's ``shardwise run`` forked from the session's fork server."""
    return ["--python", python_wrapper(str(tmp_path_factory.mktemp("python")))]


def _hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    return str(path)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _recorded_pids(directory: Path) -> list[int]:
    """Every worker's pid and its agent's pid, as the workers wrote them."""
    return [int(p) for f in directory.glob("rank_*") if not f.name.endswith(".tmp") for p in f.read_text().split()]


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def test_hostfile_world_of_four_over_ssh(sshd: LoopbackSshd, tmp_path: Path, forked_python: list[str]) -> None:
    hostfile = _hostfile(
        tmp_path, "# two loopback 'hosts', two processes each\n127.0.0.1 slots=2\n\nlocalhost slots=2  # node 1\n"
    )
    proc = subprocess.run(
        SHARDWISE
        + [
            "run",
            "--hostfile",
            hostfile,
            "--ssh-config",
            str(sshd.config),
            *forked_python,
            "--rdzv-timeout",
            "60",
            str(SCRIPTS / "report_world.py"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    worlds = {}  # rank -> (host prefix of its output line, its fields); two ranks of one host may share a line
    for line in proc.stdout.splitlines():
        host = re.match(r"\[(\S+)\] ", line)
        for fields in re.findall(r"WORLD (.*?sum=\d+)", line):
            kv = dict(x.split("=") for x in fields.split())
            worlds[int(kv["rank"])] = (host.group(1) if host else None, kv)
    assert sorted(worlds) == [0, 1, 2, 3], proc.stdout
    assert all(kv["world"] == "4" and kv["sum"] == "10" for _, kv in worlds.values())  # the all-reduce over both hosts
    assert {r: (h, kv["node"]) for r, (h, kv) in worlds.items()} == {
        0: ("127.0.0.1", "0"), 1: ("127.0.0.1", "0"), 2: ("localhost", "1"), 3: ("localhost", "1")}
    assert "pre-flight ok on 2 host(s)" in proc.stderr


def test_failing_host_stops_every_host(sshd: LoopbackSshd, tmp_path: Path, forked_python: list[str]) -> None:
    """Node 1's script exits 3 once node 0's workers run; node 0's workers and agent must go too."""
    env = dict(os.environ, SW_TEST_DIR=str(tmp_path), SW_TEST_FAIL_NODE="1")
    start = time.monotonic()
    proc = subprocess.run(
        SHARDWISE
        + [
            "run",
            "--hosts",
            "127.0.0.1:2,localhost:2",
            "--ssh-config",
            str(sshd.config),
            "--env",
            "SW_TEST_DIR",
            "--env",
            "SW_TEST_FAIL_NODE",
            *forked_python,
            "--rdzv-timeout",
            "60",
            str(SCRIPTS / "hold_or_fail.py"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "[localhost] FAILING rank=2" in proc.stdout or "[localhost] FAILING rank=3" in proc.stdout, proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "shardwise run: error: host localhost (node 1) failed, exit code 1; every other host was stopped"
    ), last
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 8  # 4 workers and the agent of each
    assert _wait_gone(pids, 15) == [], "processes outlived the job"
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_stopping_the_launcher_stops_every_host(sshd: LoopbackSshd, tmp_path: Path, how: str) -> None:
    """Ctrl-C (SIGINT) stops every host and exits 130; even a SIGKILLed launcher leaves no remote
    process behind (their ssh sessions' stdin closes, which each remote ``shardwise run`` watches)."""
    env = dict(os.environ, SW_TEST_DIR=str(tmp_path))
    launcher = subprocess.Popen(
        SHARDWISE
        + [
            "run",
            "--hosts",
            "127.0.0.1:1,localhost:1",
            "--ssh-config",
            str(sshd.config),
            "--env",
            "SW_TEST_DIR",
            str(SCRIPTS / "hold_or_fail.py"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 120
        while len(_recorded_pids(tmp_path)) < 4 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
        pids = _recorded_pids(tmp_path)
        assert len(pids) == 4, launcher.communicate(timeout=60)
        launcher.send_signal(getattr(signal, how))
        sent = time.monotonic()
        try:
            out, err = launcher.communicate(timeout=90)
        except subprocess.TimeoutExpired:  # say where it was stuck: its output, and the processes still alive
            launcher.kill()
            out, err = launcher.communicate(timeout=30)
            pytest.fail(f"the launcher had not exited {time.monotonic() - sent:.0f} s after {how}; still alive: "
                        f"{[p for p in pids if _alive(p)]}\nstderr:\n{err[-4000:]}\nstdout:\n{out[-2000:]}")
        assert launcher.returncode == (130 if how == "SIGINT" else -signal.SIGKILL), err[-3000:]
        if how == "SIGINT":
            assert err.strip().splitlines()[-1] == "shardwise run: interrupted; every host was stopped", err
        assert _wait_gone(pids, 60) == [], "processes outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_unreachable_host_is_one_line_within_the_timeout(sshd: LoopbackSshd, tmp_path: Path, kind: str) -> None:
    """A loopback port with nothing listening (refused at once), or one that accepts and never
    speaks (ssh's ConnectTimeout): one line naming the host, nothing started anywhere."""
    with socket.socket() as silent:
        if kind == "silent":
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            port = silent.getsockname()[1]
        else:
            port = free_port()
        config = sshd.config_with({"deadhost": port})
        hostfile = _hostfile(tmp_path, "127.0.0.1 slots=1\ndeadhost slots=1\n")
        start = time.monotonic()
        proc = subprocess.run(
            SHARDWISE
            + [
                "run",
                "--hostfile",
                hostfile,
                "--ssh-config",
                str(config),
                "--ssh-timeout",
                "3",
                str(SCRIPTS / "report_world.py"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("shardwise run: error: host deadhost: not reachable by ssh ("), lines[0]
    assert "Traceback" not in proc.stderr and "WORLD" not in proc.stdout
    assert elapsed < 30, elapsed


def test_doctor_checks_collectives_across_hosts(sshd: LoopbackSshd, forked_python: list[str]) -> None:
    proc = subprocess.run(
        SHARDWISE
        + [
            "doctor",
            "--hosts",
            "127.0.0.1:1,localhost:1",
            "--ssh-config",
            str(sshd.config),
            *forked_python,
            "--max-size-mb",
            "0.1",
            "--iters",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"node 0\s+127\.0\.0\.1\s+ok: .*torch", proc.stdout) and re.search(
        r"node 1\s+localhost\s+ok:", proc.stdout
    )
    assert "collectives on 2 processes over 2 node(s)" in proc.stdout
    for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"):
        assert re.search(rf"\[127\.0\.0\.1\]\s+{op}\s+ok", proc.stdout), proc.stdout
    assert "all checks passed" in proc.stdout


def test_elastic_job_keeps_its_rendezvous_store_on_the_launcher(sshd: LoopbackSshd, forked_python: list[str]) -> None:
    """``--nnodes 1:2``: the store lives in this launcher (no node is special), every host reaches it."""
    proc = subprocess.run(
        python("-m", "shardwise")
        + [
            "run",
            "--hosts",
            "127.0.0.1:1,localhost:1",
            "--ssh-config",
            str(sshd.config),
            *forked_python,
            "--nnodes",
            "1:2",
            "--max-restarts",
            "1",
            "--rdzv-timeout",
            "60",
            "--rdzv-conf",
            "last_call_timeout=2",
            str(SCRIPTS / "report_world.py"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(
        r"pre-flight ok on 2 host\(s\) .* elastic 1:2 nodes, rendezvous id \w+, rendezvous store on this machine, "
        r"port \d+$",
        proc.stderr,
        re.M,
    ), proc.stderr
    assert sorted(re.findall(r"WORLD rank=(\d) world=2 .* sum=3", proc.stdout)) == ["0", "1"], proc.stdout


def test_unreachable_rendezvous_store_is_one_line_per_host_before_anything_starts(sshd: LoopbackSshd) -> None:
    port = free_port()  # nothing listens there
    proc = subprocess.run(
        SHARDWISE
        + [
            "run",
            "--hosts",
            "127.0.0.1:1,localhost:1",
            "--ssh-config",
            str(sshd.config),
            "--nnodes",
            "1:2",
            "--rdzv-store",
            f"127.0.0.1:{port}",
            str(SCRIPTS / "report_world.py"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0] == "shardwise run: error: pre-flight found 2 problems, nothing was started:", proc.stderr
    for host, line in zip(("127.0.0.1", "localhost"), lines[1:]):
        assert line.startswith(
            f"  host {host}: cannot reach the rendezvous store at 127.0.0.1:{port}: Connection refused; "
        ), line
    assert len(lines) == 3 and "WORLD" not in proc.stdout


@pytest.mark.slow_allowed(
    seconds=120, why="two fault-tolerant replica groups started over ssh, each a torchft manager and a short run"
)
def test_fault_tolerant_groups_over_hosts(sshd: LoopbackSshd, tmp_path: Path, forked_python: list[str]) -> None:
    """``--ft-replicas 2`` over two hosts: one group per host, each with its own rendezvous, both
    meeting at the lighthouse this launcher hosts; no failure, so both commit every step and end
    with bitwise equal weights."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchft", reason="needs shardwise[ft] (torchft)")
    from tests.integration import ft_harness as h

    out = tmp_path / "out"
    proc = subprocess.run(
        python("-m", "shardwise")
        + [
            "run",
            "--hosts",
            "127.0.0.1:1,localhost:1",
            "--ssh-config",
            str(sshd.config),
            *forked_python,
            "--ft-replicas",
            "2",
            "--ft-min-replicas",
            "2",
            "--ft-dir",
            str(tmp_path / "ft"),
            *h.FAST,
            "--rdzv-timeout",
            "60",
            str(h.SCRIPT),
            str(out),
            "dp",
            "3",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(
        r"2 replica group\(s\) of 1 host\(s\), lighthouse on this machine, 127\.0\.0\.1:\d+", proc.stderr
    ), proc.stderr
    assert re.search(r"\[127\.0\.0\.1\] .*STEP 0 3 ", proc.stdout) and re.search(
        r"\[localhost\] .*STEP 1 3 ", proc.stdout
    ), proc.stdout
    got = [torch.load(out / f"replica{r}.pt", weights_only=False) for r in (0, 1)]
    assert got[0]["step"] == got[1]["step"] == 3
    assert all(torch.equal(got[0]["weights"][k], got[1]["weights"][k]) for k in got[0]["weights"])
    summary = json.loads((tmp_path / "ft" / "summary.json").read_text())  # the hosts share this machine's disk
    assert summary["committed_steps"] == 3 and summary["discarded_steps"] == 0 and summary["replicas"] == 2
