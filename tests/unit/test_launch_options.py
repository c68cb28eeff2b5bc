"""``shardwise run`` flags -> torch's LaunchConfig, checked without starting processes."""

from __future__ import annotations

import socket
import sys

import pytest

from shardwise.errors import LaunchError
from shardwise.launch.options import RunOptions, resolve


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_single_node_binds_rendezvous_to_loopback(script: str) -> None:
    launch = resolve(RunOptions(script=script, script_args=("--lr", "1"), nproc_per_node="3"), environ={})
    cfg = launch.config
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node, cfg.rdzv_backend) == (1, 1, 3, "c10d")
    assert cfg.rdzv_endpoint.startswith("127.0.0.1:") and cfg.local_addr == "127.0.0.1"
    assert launch.entrypoint == sys.executable
    assert launch.args == ("-u", script, "--lr", "1")
    assert launch.worker_env["OMP_NUM_THREADS"] >= "1"


def test_module_target() -> None:
    launch = resolve(RunOptions(script="json.tool", module=True, nproc_per_node="1"), environ={})
    assert launch.args[:3] == ("-u", "-m", "json.tool")


def test_multi_node_static(script: str) -> None:
    opts = RunOptions(script=script, nproc_per_node="2", nnodes="2", node_rank=1, master_addr="127.0.0.1", master_port=29999)
    cfg = resolve(opts, environ={}).config
    assert (cfg.min_nodes, cfg.max_nodes, cfg.rdzv_backend, cfg.rdzv_endpoint) == (2, 2, "static", "127.0.0.1:29999")
    assert cfg.rdzv_configs["rank"] == 1 and cfg.max_restarts == 0


def test_elastic_range_needs_dynamic_rendezvous(script: str) -> None:
    with pytest.raises(LaunchError, match="elastic world"):
        resolve(RunOptions(script=script, nnodes="1:4", nproc_per_node="1"), environ={})
    cfg = resolve(RunOptions(script=script, nnodes="1:4", nproc_per_node="1", rdzv_endpoint="h:1", rdzv_id="j"), environ={}).config
    assert (cfg.min_nodes, cfg.max_nodes, cfg.rdzv_backend, cfg.run_id) == (1, 4, "c10d", "j")


def test_inside_srun_takes_topology_from_slurm(script: str) -> None:
    env = {"SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1",
           "SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "localhost,node4"}
    cfg = resolve(RunOptions(script=script, nproc_per_node="4"), environ=env).config
    assert (cfg.max_nodes, cfg.rdzv_configs["rank"], cfg.rdzv_endpoint, cfg.run_id) == (2, 1, f"localhost:{15000 + 77}", "77")


@pytest.mark.parametrize(
    ("opts", "pattern"),
    [
        (dict(script="/no/such/script.py"), "does not exist"),
        (dict(script="no_such_module_xyz", module=True), "cannot be imported"),
        (dict(nproc_per_node="0"), "must be at least 1"),
        (dict(nproc_per_node="many"), "is not a number"),
        (dict(nnodes="2"), "needs to know where node 0 is"),
        (dict(nnodes="0"), "0 < MIN <= MAX"),
        (dict(nnodes="3:1"), "0 < MIN <= MAX"),
        (dict(nnodes="2", node_rank=2, master_addr="127.0.0.1", master_port=29998), "outside 0..1"),
        (dict(nnodes="2", master_addr="no-such-host.invalid", master_port=29998), "does not resolve"),
        (dict(max_restarts=-1), "negative"),
    ],
)
def test_bad_flags(script: str, opts: dict, pattern: str) -> None:
    opts = {"script": script, **opts}
    with pytest.raises(LaunchError, match=pattern):
        resolve(RunOptions(**opts), environ={})


def test_port_in_use(script: str) -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {port} is already in use"):
            resolve(RunOptions(script=script, nnodes="2", node_rank=0, master_addr="127.0.0.1", master_port=port), environ={})


def test_srun_with_one_task_per_gpu_is_refused(script: str) -> None:
    env = {"SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "16", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n[1-2]"}
    with pytest.raises(LaunchError, match="one task per node"):
        resolve(RunOptions(script=script), environ=env)
