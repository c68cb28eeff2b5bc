"""The multi-host launcher's pure parts: hostfiles, ssh command lines, the forwarded environment,
pre-flight judgement, per-node flags; and, with local commands standing in for ssh, how sessions
stream, fail together and stop, and how a remote node dies with its session's stdin."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from shardwise.errors import LaunchError
from shardwise.launch.hosts import Host, hosts_from, parse_hostfile, parse_hosts
from shardwise.launch.multihost import World, check_topology, node_args
from shardwise.launch.options import RunOptions
from shardwise.launch.preflight import HostFacts, Target, check, judge, Preflight
from shardwise.launch.probe import probe
from shardwise.launch.sessions import Session, Sessions
from shardwise.launch.ssh import SshOptions, forwarded_env, remote_command, ssh_argv


# -- hosts ----------------------------------------------------------------------------------------
def test_hostfile_deepspeed_and_openmpi_lines() -> None:
    text = "# cluster\nnode1 slots=8\n\n  node2 slots=8 max_slots=16  # second\nuser@10.0.0.3\n[::1] slots=2\n"
    assert parse_hostfile(text) == (Host("node1", 8), Host("node2", 8), Host("user@10.0.0.3"), Host("[::1]", 2))


def test_hosts_list_like_mpirun() -> None:
    assert parse_hosts("node1:4,node2:4") == (Host("node1", 4), Host("node2", 4))
    assert parse_hosts("a, b:2 ,c:") == (Host("a"), Host("b", 2), Host("c"))


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("node1 slots=0\n", r"line 1: slots='0' is not a positive number"),
        ("node1 gpus=8\n", r"line 1: 'gpus=8' is not understood; write 'host slots=N'"),
        ("# nothing\n\n", r"names no hosts"),
        ("a slots=1\na slots=2\n", r"host 'a' is listed twice"),
        ("-oProxyCommand=x slots=1\n", r"is not a host name"),
        ("bad;name\n", r"is not a host name"),
    ],
)
def test_bad_hostfile_is_one_line(text: str, pattern: str) -> None:
    with pytest.raises(LaunchError, match=pattern) as err:
        parse_hostfile(text)
    assert "\n" not in str(err.value)


def test_hosts_from_needs_exactly_one_source(tmp_path) -> None:
    with pytest.raises(LaunchError, match="both name the hosts"):
        hosts_from("f", "a:1")
    with pytest.raises(LaunchError, match="cannot be read"):
        hosts_from(str(tmp_path / "missing"), None)
    with pytest.raises(LaunchError, match="not a positive number"):
        parse_hosts("a:x")


# -- ssh ------------------------------------------------------------------------------------------
def test_ssh_argv_batch_mode_first_and_user_options_before_defaults(tmp_path) -> None:
    cfg = tmp_path / "cfg"
    cfg.write_text("")
    argv = ssh_argv(
        "node1", "true", SshOptions(config_file=str(cfg), options=("ConnectTimeout=3",), connect_timeout_s=7)
    )
    assert argv[:5] == ["ssh", "-T", "-x", "-o", "BatchMode=yes"]
    assert argv[argv.index("-F") + 1] == str(cfg)
    assert argv.index("ConnectTimeout=3") < argv.index("ConnectTimeout=7")  # ssh keeps the first value
    assert argv[-3:] == ["--", "node1", "true"]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"options": ("Port",)}, "not KEY=VALUE"),
        ({"connect_timeout_s": 0}, "at least 1"),
        ({"config_file": "/no/such/ssh_config"}, "does not exist"),
    ],
)
def test_bad_ssh_options(kwargs, pattern) -> None:
    with pytest.raises(LaunchError, match=pattern):
        SshOptions(**kwargs)


def test_remote_command_quotes_every_word() -> None:
    line = remote_command(
        ["/opt/my env/python", "-m", "shardwise", "run", "it's.py", "--x", "a b"], env={"A": "1 2"}, chdir="/w d"
    )
    assert line.startswith("cd '/w d' && exec env A='1 2' ")
    words = shlex.split(line.split("&& ", 1)[1])
    assert words == ["exec", "env", "A=1 2", "/opt/my env/python", "-m", "shardwise", "run", "it's.py", "--x", "a b"]


def test_forwarded_environment() -> None:
    env = {
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
        "PYTHONPATH": "/p",
        "SHARDWISE_HANG_TIMEOUT": "60",
        "HOME": "/root",
        "WANDB_API_KEY": "k",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    assert forwarded_env(env, ["WANDB_API_KEY", "EXTRA=1"]) == {
        "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/p", "SHARDWISE_HANG_TIMEOUT": "60",
        "WANDB_API_KEY": "k", "EXTRA": "1"}
    with pytest.raises(LaunchError, match="--env MISSING is not set here"):
        forwarded_env(env, ["MISSING"])
    with pytest.raises(LaunchError, match="does not start with a variable name"):
        forwarded_env(env, ["=x"])


# -- pre-flight -----------------------------------------------------------------------------------
def _target(**kw) -> Target:
    return Target(**{"python": "/venv/bin/python", "chdir": "/work", "script": "train.py", "module": False,
                     "master_addr": "node1", "master_port": None, **kw})


def _facts(**kw) -> dict:
    return {
        "hostname": "h",
        "python": "3.11.7",
        "torch": "2.13.0",
        "shardwise": "0.1.0",
        "chdir_ok": True,
        "script_ok": True,
        "master_resolves": True,
        **kw,
    }


def test_judge_names_every_problem_by_host() -> None:
    facts = [HostFacts(Host("node1"), _facts(free_port=4242)),
             HostFacts(Host("node2"), _facts(torch="2.12.0", script_ok=False, master_resolves=False)),
             HostFacts(Host("node3"), None, "not reachable by ssh (Connection refused); check ..."),
             HostFacts(Host("node4"), _facts(shardwise=None, chdir_ok=False))]
    problems, port = judge(facts, _target())
    assert port == 4242  # node 0 named a free port
    assert problems == [
        "host node2: torch 2.12.0 differs from torch 2.13.0 on node1; install the same versions on every host",
        "host node2: script train.py does not exist in /work; copy it there (or use a shared file system)",
        "host node2: the master address 'node1' does not resolve there; pass --master-addr with an address every host "
        "can reach",
        "host node3: not reachable by ssh (Connection refused); check ...",
        "host node4: shardwise is not installed for /venv/bin/python; install it (or pass --python PATH)",
        "host node4: directory /work does not exist there; use the same path on every host, or pass --chdir DIR",
    ]
    with pytest.raises(LaunchError, match=r"pre-flight found 6 problems, nothing was started:\n  host node2"):
        check(Preflight(tuple(facts), tuple(problems), port))
    with pytest.raises(LaunchError) as one:
        check(Preflight(tuple(facts[2:3]), (problems[3],), None))
    assert str(one.value) == problems[3]  # a single problem stays a single line


def test_judge_master_port_in_use_on_node_0() -> None:
    problems, port = judge(
        [HostFacts(Host("a"), _facts(port_free=False)), HostFacts(Host("b"), _facts())], _target(master_port=29500)
    )
    assert problems == ["host a: the master port 29500 is in use there; pick another --master-port"] and port == 29500


def test_probe_runs_here(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the probe changes directory (it runs as its own process over ssh)
    (tmp_path / "train.py").write_text("")
    facts = probe(str(tmp_path), "train.py", False, "127.0.0.1", None, True)
    assert facts["chdir_ok"] and facts["script_ok"] and facts["master_resolves"] and facts["free_port"] > 0
    assert facts["torch"] and facts["shardwise"]
    assert probe(str(tmp_path), "json", True, "no-such-host.invalid", None, False)["master_resolves"] is False


# -- per-node flags -------------------------------------------------------------------------------
def test_node_args_static_and_elastic() -> None:
    opts = RunOptions(script="train.py", script_args=("--lr", "1"))
    static = World(nnodes="2", elastic=False, master_addr="10.0.0.1", master_port=29500, run_id="r")
    args = node_args(opts, Host("b", 4), 1, static, hang_timeout_s=60)
    restarting = " ".join(
        node_args(RunOptions(script="t.py", max_restarts=2), Host("b"), 1, static, hang_timeout_s=None)
    )
    assert "--rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500" in restarting  # a restart must re-form every node
    assert args[:1] == ["--stop-with-stdin"] and args[-3:] == ["train.py", "--lr", "1"]
    assert " ".join(args).count("--node-rank 1 --master-addr 10.0.0.1 --master-port 29500") == 1
    assert "--nproc-per-node 4" in " ".join(args) and "--hang-timeout 60" in " ".join(args)
    elastic = World(nnodes="1:2", elastic=True, master_addr="10.0.0.1", master_port=29500, run_id="job")
    a0, a1 = (
        " ".join(
            node_args(
                RunOptions(script="t.py", rdzv_conf="last_call_timeout=5"), Host(n), r, elastic, hang_timeout_s=None
            )
        )
        for r, n in ((0, "a"), (1, "b"))
    )
    assert (
        "--rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id job --rdzv-conf last_call_timeout=5,is_host=1"
        in a0
    )
    assert "is_host=0" in a1 and "--node-rank" not in a1 and "--nproc-per-node auto" in a1


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"nnodes": "3"}, r"--nnodes 3 but 2 hosts"),
        ({"nnodes": "3:4"}, r"does not admit the 2 hosts"),
        ({"node_rank": 1}, r"--node-rank cannot be combined"),
        ({"rdzv_endpoint": "h:1"}, r"--rdzv-endpoint cannot be combined"),
    ],
)
def test_topology_errors(kw, pattern) -> None:
    with pytest.raises(LaunchError, match=pattern):
        check_topology(RunOptions(script="t.py", **kw), (Host("a"), Host("b")))
    assert check_topology(RunOptions(script="t.py"), (Host("a"), Host("b"))) == ("2", False)
    assert check_topology(RunOptions(script="t.py", nnodes="1:4"), (Host("a"), Host("b"))) == ("1:4", True)


# -- sessions, with local shells standing in for ssh ----------------------------------------------
def _sh(label: str, script: str) -> Session:
    return Session(label, ("sh", "-c", script))


def test_sessions_prefix_output_and_succeed(capfd) -> None:
    with Sessions([_sh("a", "echo one; echo two >&2"), _sh("b", "echo three")], stop_grace_s=5) as s:
        outcome = s.wait()
    out, err = capfd.readouterr()
    assert outcome.exit_code == 0
    assert "[a] one\n" in out and "[b] three\n" in out and "[a] two\n" in err


def test_a_failed_session_stops_the_others_and_its_code_is_the_jobs() -> None:
    start = time.monotonic()
    with Sessions([_sh("a", "exec sleep 60"), _sh("b", "sleep 0.3; exit 3")], stop_grace_s=1) as s:
        outcome = s.wait()
        assert all(p.poll() is not None for p in s.procs)
    assert (outcome.exit_code, outcome.failed, outcome.failed_code) == (3, "b", 3)
    assert time.monotonic() - start < 15


def test_stop_closes_stdin_first() -> None:
    """A session that ends on its own when stdin closes is not killed (the remote side's cue)."""
    with Sessions([_sh("a", "cat >/dev/null; exit 7")], stop_grace_s=10) as s:
        time.sleep(0.2)
        s.stop(grace_s=10)
        assert s.procs[0].returncode == 7


def test_elastic_sessions_go_on_above_the_minimum() -> None:
    with Sessions([_sh("a", "sleep 1; exit 0"), _sh("b", "exit 5")], stop_grace_s=5) as s:
        outcome = s.wait(min_alive=1)
    assert outcome.exit_code == 0 and outcome.lost == ("b",)


def test_replica_group_sessions_stop_the_stragglers_after_the_grace() -> None:
    """Fault-tolerant groups: one finished, the other (say still restarting) is stopped after the grace."""
    start = time.monotonic()
    with Sessions([_sh("a", "sleep 0.2; exit 0"), _sh("b", "exec sleep 60")], stop_grace_s=1) as s:
        outcome = s.wait(min_alive=1, finish_grace_s=0.5)
        assert all(p.poll() is not None for p in s.procs)
    assert outcome.exit_code == 0 and time.monotonic() - start < 15


# -- the remote half: a node dies with its session's stdin ----------------------------------------
def test_stdin_lifeline_stops_the_node_and_its_children(tmp_path) -> None:
    code = (
        "import os, signal, subprocess, sys, time\n"
        "from shardwise.launch.lifeline import stop_with_stdin\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
        "signal.SIG_IGN); time.sleep(60)'], start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stubborn node: only the SIGKILL stage ends it\n"
        "stop_with_stdin(grace_s=1.0)\n"
        "time.sleep(60)\n"
    )
    node = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = int(node.stdout.readline())
    node.stdin.close()  # the ssh session ended
    assert node.wait(timeout=20) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
            with open(f"/proc/{child}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except (ProcessLookupError, FileNotFoundError):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the child outlived its node")


def _interrupted_sessions(script: str, signals: int, grace_s: float) -> tuple[str, float]:
    """Run Sessions in a child process, Ctrl-C it ``signals`` times once its session started;
    return the child's stdout and the seconds from the first SIGINT to its exit."""
    code = ("import sys\n"
            "from shardwise.launch.sessions import Session, Sessions\n"
            f"with Sessions([Session('a', ('sh', '-c', {script!r}))], stop_grace_s={grace_s}) as s:\n"
            "    print('READY', flush=True)\n"
            "    o = s.wait()\n"
            "print('OUTCOME', o.exit_code, o.interrupted, flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        time.sleep(0.5)  # the child is in wait(), polling its session
        start = time.monotonic()
        for _ in range(signals):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
        out, err = proc.communicate(timeout=60)
        return out, time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_stops_the_sessions_and_says_interrupted() -> None:
    """SIGINT is counted, not raised mid-poll: the session (which ends when its stdin closes) is
    stopped in its grace period and the outcome is 130, interrupted."""
    out, took = _interrupted_sessions("cat >/dev/null; exit 0", signals=1, grace_s=30)
    assert "OUTCOME 130 True" in out, out
    assert took < 10, took


def test_a_second_ctrl_c_skips_the_grace_period() -> None:
    """A session that ignores its stdin closing is killed at once after a second Ctrl-C, not after
    the 30 s grace period."""
    out, took = _interrupted_sessions("exec sleep 60", signals=2, grace_s=30)
    assert "OUTCOME 130 True" in out, out
    assert took < 15, took
