"""``shardwise run --hostfile --ft-replicas R``: the commands every host would run (no ssh, no process)."""

from __future__ import annotations

import argparse

import pytest

from shardwise.errors import LaunchError
from shardwise.launch.ft import FtOptions
from shardwise.launch.ft_hosts import check_ft_hosts, group_nodes, split_hosts
from shardwise.launch.hosts import Host
from shardwise.launch.options import RunOptions

HOSTS = tuple(Host(f"n{i}", 2) for i in range(4))


def _parse(args: tuple[str, ...]) -> argparse.Namespace:
    """A node's arguments as ``shardwise run`` itself reads them."""
    from shardwise.cli import build_parser

    return build_parser().parse_args(["run", *args])


def test_each_group_runs_on_its_hosts_with_its_own_rendezvous_and_the_lighthouse() -> None:
    options = RunOptions(script="train.py", script_args=("--lr", "1"), max_restarts=3)
    ft = FtOptions(replicas=2, min_replicas=1, timeout_s=20, quorum_timeout_s=40)
    stores = [f"10.0.0.9:{29400}"] * 4
    lighthouses = ["10.0.0.9:29510"] * 4
    nodes = group_nodes(
        options, HOSTS, ft, store_endpoints=stores, lighthouses=lighthouses, run_id="job", hang_timeout_s=None
    )
    assert [(n.host.name, n.replica) for n in nodes] == [("n0", 0), ("n1", 0), ("n2", 1), ("n3", 1)]
    parsed = [_parse(n.args) for n in nodes]
    for node, args in zip(nodes, parsed):
        assert (args.ft_replicas, args.ft_replica_id, args.lighthouse) == (2, node.replica, "10.0.0.9:29510")
        assert (args.ft_min_replicas, args.ft_timeout, args.ft_quorum_timeout) == (1, 20, 40)
        assert args.nnodes == "2" and args.rdzv_backend == "c10d" and args.rdzv_endpoint == "10.0.0.9:29400"
        assert args.rdzv_conf == "is_host=0" and args.max_restarts == 3 and args.nproc_per_node == "2"
        assert (args.script, args.script_args, args.hostfile, args.node_rank) == ("train.py", ["--lr", "1"], None, None)
    assert [a.rdzv_id for a in parsed] == ["job-ft0", "job-ft0", "job-ft1", "job-ft1"]  # one rendezvous per group


def test_module_targets_and_per_host_addresses_stay_in_place() -> None:
    options = RunOptions(script="pkg.train", module=True, script_args=("-x",))
    ft = FtOptions(replicas=2)
    nodes = group_nodes(options, HOSTS[:2], ft, store_endpoints=["a:1", "b:1"], lighthouses=["a:2", "b:2"],
                        run_id="r", hang_timeout_s=120)
    assert [n.args[-3:] for n in nodes] == [("-m", "pkg.train", "-x")] * 2
    parsed = [_parse(n.args) for n in nodes]
    assert [(a.rdzv_endpoint, a.lighthouse, a.rdzv_id) for a in parsed] == [
        ("a:1", "a:2", "r-ft0"),
        ("b:1", "b:2", "r-ft1"),
    ]
    assert all(a.module and a.hang_timeout == 120 and a.nnodes == "1" for a in parsed)


@pytest.mark.parametrize(("hosts", "replicas", "pattern"), [(3, 2, "--ft-replicas 2 does not divide the 3 hosts"),
                                                           (2, 4, "--ft-replicas 4 does not divide the 2 hosts")])
def test_hosts_must_split_evenly(hosts: int, replicas: int, pattern: str) -> None:
    with pytest.raises(LaunchError, match=pattern):
        split_hosts(HOSTS[:hosts], replicas)


@pytest.mark.parametrize(("kw", "ft", "store", "pattern"), [
    ({}, FtOptions(replicas=2, replica_id=0, lighthouse="h:1"), None, "--ft-replica-id cannot be combined"),
    ({"nnodes": "2"}, FtOptions(replicas=2), None, "--nnodes cannot be combined"),
    ({"master_port": 29500}, FtOptions(replicas=2), None, "--master-port cannot be combined"),
    ({}, FtOptions(replicas=2), "node0", "--rdzv-store node0 cannot be combined"),
    ({}, FtOptions(replicas=2), "login:29400", "also give --lighthouse"),
])
def test_what_a_fault_tolerant_hostfile_job_refuses(kw: dict, ft: FtOptions, store: str | None, pattern: str) -> None:
    with pytest.raises(LaunchError, match=pattern):
        check_ft_hosts(RunOptions(script="t.py", **kw), ft, store)
    check_ft_hosts(
        RunOptions(script="t.py"), FtOptions(replicas=2, lighthouse="h:1"), "login:29400"
    )  # both off the launcher: fine


def test_the_cli_refuses_an_uneven_split_in_one_line(tmp_path, capsys) -> None:
    from shardwise.cli import main

    (tmp_path / "train.py").write_text("")
    code = main(["run", "--hosts", "a:1,b:1,c:1", "--ft-replicas", "2", str(tmp_path / "train.py")])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 1
        and any("--ft-replicas 2 does not divide the 3 hosts" in line for line in err)
        and "Traceback" not in "\n".join(err)
    )
