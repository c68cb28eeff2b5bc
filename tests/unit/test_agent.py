"""The elastic agent's peer watch (pure, on snapshots), the torch internals it reads (a real c10d
rendezvous against a store hosted off the nodes), and where a --hostfile job keeps that store."""

from __future__ import annotations

import socket
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from shardwise.errors import LaunchError
from shardwise.launch.agent import PeerWatch, _rendezvous_view, expiry_s
from shardwise.launch.hosts import Host
from shardwise.launch.multihost import World, endpoint, node_args, store_choice
from shardwise.launch.options import RunOptions
from shardwise.launch.preflight import HostFacts, Target, judge
from shardwise.launch.probe import _store
from shardwise.launch.store import host_store, parse_endpoint

REPO = Path(__file__).resolve().parents[2]
ME, PEER, OTHER = "me", "peer", "other"


def _watch() -> PeerWatch:
    w = PeerWatch(me=ME, expiry_s=5.0)
    w.joined(round=3, participants={ME: 0, PEER: 1, OTHER: 2}, now=100.0)
    return w


def test_peer_watch_names_the_peer_whose_heartbeat_stopped_on_this_nodes_clock() -> None:
    w = _watch()
    t = datetime(2030, 1, 1, tzinfo=timezone.utc)  # another node's wall clock: only changes count
    both = {ME: t, PEER: t, OTHER: t}
    assert w.check(round=3, participants={ME: 0, PEER: 1, OTHER: 2}, heartbeats=both, now=101.0).silent == ()
    for i in range(1, 5):  # OTHER keeps beating, PEER stops after its first value
        beats = {ME: t, PEER: t, OTHER: t + timedelta(seconds=i)}
        verdict = w.check(round=3, participants={ME: 0, PEER: 1, OTHER: 2}, heartbeats=beats, now=101.0 + i)
        assert verdict.silent == () and not verdict.dropped
    verdict = w.check(
        round=3,
        participants={ME: 0, PEER: 1, OTHER: 2},
        heartbeats={ME: t, PEER: t, OTHER: t + timedelta(seconds=9)},
        now=106.5,
    )
    assert [(s.node, s.node_rank) for s in verdict.silent] == [(PEER, 1)] and verdict.silent[
        0
    ].silent_s == pytest.approx(5.5)
    assert "node 1 (peer, agent pid ?) sent no heartbeat for 6 s" == verdict.silent[0].describe()


def test_peer_watch_counts_on_when_torch_already_removed_the_dead_node() -> None:
    w = _watch()
    t = datetime(2030, 1, 1, tzinfo=timezone.utc)
    w.check(round=3, participants={ME: 0, PEER: 1, OTHER: 2}, heartbeats={ME: t, PEER: t, OTHER: t}, now=100.5)
    # torch's sanitize dropped PEER from the state it read: the count does not restart
    verdict = w.check(
        round=3, participants={ME: 0, OTHER: 2}, heartbeats={ME: t, OTHER: t + timedelta(seconds=5)}, now=105.6
    )
    assert [s.node for s in verdict.silent] == [PEER]


def test_peer_watch_sees_this_node_dropped_from_its_round() -> None:
    w = _watch()
    t = datetime(2030, 1, 1, tzinfo=timezone.utc)
    assert w.check(round=4, participants={PEER: 0}, heartbeats={PEER: t}, now=101.0).dropped  # a later round went on
    assert w.check(
        round=3, participants={PEER: 1, OTHER: 2}, heartbeats={PEER: t}, now=101.0
    ).dropped  # removed as dead
    assert not w.check(
        round=3, participants={ME: 0}, heartbeats={ME: t}, now=101.0
    ).dropped  # others left for a re-form
    assert (
        not PeerWatch(me=ME, expiry_s=5.0).check(round=0, participants={}, heartbeats={}, now=0.0).dropped
    )  # not joined yet


def test_the_torch_rendezvous_internals_the_agent_reads() -> None:
    """A real c10d rendezvous handler (torch 2.13) against a store hosted off the nodes."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry

    hosted = host_store(0)
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{hosted.port}",
        run_id="pin",
        min_nodes=1,
        max_nodes=1,
        is_host="0",
        keep_alive_interval=2,
        keep_alive_max_attempt=4,
    )
    handler = registry.get_rendezvous_handler(params)
    try:
        assert expiry_s(handler) == 8.0
        handler.next_rendezvous()
        round_, participants, heartbeats = _rendezvous_view(handler)
        me = handler._this_node
        assert participants == {me: 0} and me in heartbeats and round_ == 0
        watch = PeerWatch(me=me, expiry_s=8.0)
        watch.joined(round=round_, participants=participants, now=0.0)
        assert watch.check(round=round_, participants=participants, heartbeats=heartbeats, now=1.0).dropped is False
    finally:
        handler.shutdown()
    assert _rendezvous_view(object()) is None and expiry_s(object()) is None  # e.g. the static rendezvous: no watch


def test_store_host_refuses_a_taken_port_in_one_line() -> None:
    with socket.socket() as taken:  # another process's listener (one process shares its own stores by port)
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            LaunchError, match=rf"cannot serve the rendezvous store on port {port}: .*; pick another --port"
        ):
            host_store(port)
    done = subprocess.run(
        [sys.executable, "-m", "shardwise", "rendezvous", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "shardwise rendezvous: error: --port 70000 is not a port; use 1-65535 (0: any free port), e.g. --port 29400"]


def test_store_choice_of_a_hostfile_job() -> None:
    assert store_choice(None, dynamic=True).kind == "launcher" and store_choice(None, dynamic=False).kind == "node0"
    assert store_choice("launcher:29411", dynamic=True).port == 29411
    assert store_choice("login1:29400", dynamic=True) == type(store_choice("node0", dynamic=True))(
        "host", "login1", 29400
    )
    assert store_choice("node0", dynamic=False).kind == "node0"
    with pytest.raises(LaunchError, match="needs a world that can re-form; add --nnodes MIN:MAX or --max-restarts N"):
        store_choice("launcher", dynamic=False)
    for bad in ("login1", "login1:x", "launcher:0", ":29400"):
        with pytest.raises(LaunchError, match="--rdzv-store"):
            store_choice(bad, dynamic=True)
    assert parse_endpoint("[::1]:29400", "--x") == ("::1", 29400) and endpoint("::1", 5) == "[::1]:5"


def test_every_node_is_a_client_of_a_store_off_the_nodes() -> None:
    world = World(nnodes="1:2", elastic=True, master_addr="10.0.0.1", master_port=29500, run_id="job",
                  store_endpoints=("10.0.0.9:29400", "10.1.0.9:29400"))
    a0, a1 = (
        " ".join(node_args(RunOptions(script="t.py"), Host(n), r, world, hang_timeout_s=None))
        for r, n in enumerate("ab")
    )
    assert "--rdzv-endpoint 10.0.0.9:29400 --rdzv-id job --rdzv-conf is_host=0" in a0
    assert (
        "--rdzv-endpoint 10.1.0.9:29400 --rdzv-id job --rdzv-conf is_host=0" in a1
    )  # as that host reaches the launcher


def test_preflight_names_each_host_that_cannot_reach_the_store() -> None:
    target = Target(
        python="py",
        chdir="/w",
        script="t.py",
        module=False,
        master_addr="a",
        master_port=29500,
        store_client_port=41000,
    )
    good = {
        "python": "3.11",
        "torch": "2.13.0",
        "shardwise": "0.1",
        "chdir_ok": True,
        "script_ok": True,
        "master_resolves": True,
        "port_free": True,
    }
    facts = [HostFacts(Host("a"), {**good, "store_addr": "10.0.0.9", "store_error": None}),
             HostFacts(Host("b"), {**good, "store_addr": "10.1.0.9", "store_error": "Connection refused"})]
    problems, _ = judge(facts, target)
    assert problems == [
        "host b: cannot reach the rendezvous store at 10.1.0.9:41000 (this machine, as b sees it): Connection "
        "refused; open that port to the hosts, or pass --rdzv-store HOST:PORT of a 'shardwise rendezvous' they "
        "reach (or --rdzv-store node0)"
    ]


def test_probe_reaches_the_store_from_the_ssh_client_address(monkeypatch: pytest.MonkeyPatch) -> None:
    hosted = host_store(0)
    monkeypatch.setenv("SSH_CONNECTION", "127.0.0.1 50000 127.0.0.1 22")
    assert _store(None, hosted.port) == {"store_addr": "127.0.0.1", "store_error": None}
    assert _store(f"127.0.0.1:{hosted.port}", None)["store_error"] is None
    monkeypatch.delenv("SSH_CONNECTION")
    assert "SSH_CONNECTION is not set" in str(_store(None, hosted.port)["store_error"])
    assert _store(None, None) == {}


def test_rdzv_store_without_hosts_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "shardwise", "run", "--rdzv-store", "launcher", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "shardwise run: error: --rdzv-store needs --hostfile or --hosts; on one node, use --rdzv-endpoint HOST:PORT "
        "--rdzv-conf is_host=0 of a running 'shardwise rendezvous'"], done.stderr
