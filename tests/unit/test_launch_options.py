"""``shardwise run`` flags -> torch's LaunchConfig, checked without starting processes."""

from __future__ import annotations

import os
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
    assert launch.args == ("-m", "shardwise.launch.worker_main", script, "--lr", "1")  # line-buffered, then the script
    assert launch.worker_env["OMP_NUM_THREADS"] >= "1"


def test_module_target() -> None:
    launch = resolve(RunOptions(script="json.tool", module=True, nproc_per_node="1"), environ={})
    assert launch.args[:4] == ("-m", "shardwise.launch.worker_main", "-m", "json.tool")


def test_multi_node_static(script: str) -> None:
    opts = RunOptions(
        script=script, nproc_per_node="2", nnodes="2", node_rank=1, master_addr="127.0.0.1", master_port=29999
    )
    cfg = resolve(opts, environ={}).config
    assert (cfg.min_nodes, cfg.max_nodes, cfg.rdzv_backend, cfg.rdzv_endpoint) == (2, 2, "static", "127.0.0.1:29999")
    assert cfg.rdzv_configs["rank"] == 1 and cfg.max_restarts == 0


def test_elastic_range_needs_dynamic_rendezvous(script: str) -> None:
    with pytest.raises(LaunchError, match="elastic world"):
        resolve(RunOptions(script=script, nnodes="1:4", nproc_per_node="1"), environ={})
    cfg = resolve(
        RunOptions(script=script, nnodes="1:4", nproc_per_node="1", rdzv_endpoint="h:1", rdzv_id="j"), environ={}
    ).config
    assert (cfg.min_nodes, cfg.max_nodes, cfg.rdzv_backend, cfg.run_id) == (1, 4, "c10d", "j")


def test_inside_srun_takes_topology_from_slurm(script: str) -> None:
    env = {"SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1",
           "SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "localhost,node4"}
    cfg = resolve(RunOptions(script=script, nproc_per_node="4"), environ=env).config
    assert (cfg.max_nodes, cfg.rdzv_configs["rank"], cfg.rdzv_endpoint, cfg.run_id) == (
        2,
        1,
        f"localhost:{15000 + 77}",
        "77",
    )


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
            resolve(
                RunOptions(script=script, nnodes="2", node_rank=0, master_addr="127.0.0.1", master_port=port),
                environ={},
            )


def test_srun_with_one_task_per_gpu_is_refused(script: str) -> None:
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "16",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NODELIST": "n[1-2]",
    }
    with pytest.raises(LaunchError, match="one task per node"):
        resolve(RunOptions(script=script), environ=env)


def test_output_goes_straight_through_unless_kept_or_prefixed(script: str, tmp_path) -> None:
    """No --log-dir or --log-prefix: the workers write to this process's stdout themselves (no
    files, no copying). --log-prefix: torch's agent keeps them in a temporary directory (removed
    after the run) and copies each line behind the prefix; --log-dir: in that directory."""
    from torch.distributed.elastic.multiprocessing import Std

    plain = resolve(RunOptions(script=script, nproc_per_node="2"), environ={})
    assert (
        plain.config.logs_specs._tee == Std.NONE
        and plain.config.log_line_prefix_template is None
        and plain.temp_log_dir is None
    )
    prefixed = resolve(RunOptions(script=script, nproc_per_node="2", log_prefix="[${rank}]: "), environ={})
    try:
        assert prefixed.config.logs_specs._tee == Std.ALL and prefixed.config.log_line_prefix_template == "[${rank}]: "
        assert prefixed.temp_log_dir and prefixed.config.logs_specs.root_log_dir == prefixed.temp_log_dir
    finally:
        os.rmdir(prefixed.temp_log_dir)
    kept = resolve(RunOptions(script=script, nproc_per_node="2", log_dir=str(tmp_path / "logs")), environ={})
    assert kept.config.logs_specs._tee == Std.ALL and kept.temp_log_dir is None and (tmp_path / "logs").is_dir()
    with pytest.raises(LaunchError, match="--log-prefix is empty"):
        resolve(RunOptions(script=script, log_prefix=" "), environ={})


def test_a_module_in_the_current_directory_is_found_as_python_dash_m_finds_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `shardwise` console script's sys.path starts with its bin/ directory, not the current
    one; `shardwise run -m mypkg.train` from the project directory used to be refused."""
    (tmp_path / "mypkg_here").mkdir()
    (tmp_path / "mypkg_here" / "__init__.py").write_text("")
    (tmp_path / "mypkg_here" / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    launch = resolve(RunOptions(script="mypkg_here.train", module=True, nproc_per_node="1"), environ={})
    assert launch.args[-1] == "mypkg_here.train"
    with pytest.raises(LaunchError, match="'nowhere_pkg.train' cannot be imported"):
        resolve(RunOptions(script="nowhere_pkg.train", module=True, nproc_per_node="1"), environ={})
