"""Launcher detection: torchrun, Slurm, OpenMPI, MPICH / Intel MPI, none, and contradictions."""

from __future__ import annotations

import pytest

from shardwise.errors import ShardwiseError
from shardwise.runtime.detect import detect_process


def test_no_launcher_is_a_single_process() -> None:
    info = detect_process({})
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.num_nodes) == ("none", 0, 1, 0, 1)


def test_torchrun() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x"}
    info = detect_process(env)
    assert info.launcher == "torchrun"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert (info.node_rank, info.num_nodes, info.master_addr, info.master_port) == (1, 2, "10.0.0.1", 29400)


def test_slurm_srun_task() -> None:
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "1234",
           "SLURM_JOB_NODELIST": "gpu-[01-02,05]"}
    info = detect_process(env)
    assert info.launcher == "slurm"
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node_rank, info.num_nodes) == (
        6,
        8,
        2,
        4,
        1,
        2,
    )
    assert info.master_addr == "gpu-01"
    assert info.master_port == 15000 + 1234 % 20000


def test_slurm_batch_step_without_srun_is_not_a_world() -> None:
    # sbatch's batch shell has SLURM_PROCID=0 and SLURM_NTASKS=8 but no step: a plain python there is one process.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert detect_process(env).launcher == "none"


def test_openmpi() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    info = detect_process(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.master_addr) == (
        "openmpi",
        3,
        4,
        3,
        "127.0.0.1",
    )


def test_openmpi_multi_host_needs_master_addr() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    with pytest.raises(ShardwiseError, match="MASTER_ADDR"):
        detect_process(env)
    info = detect_process({**env, "MASTER_ADDR": "node0", "MASTER_PORT": "12345"})
    assert (info.node_rank, info.num_nodes, info.master_addr, info.master_port) == (0, 2, "node0", 12345)


def test_mpich_and_intel_mpi() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h0"}
    info = detect_process(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.node_rank, info.num_nodes) == (
        "mpich",
        2,
        4,
        0,
        1,
        2,
    )


def test_mpirun_inside_slurm_allocation_prefers_mpi() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0",
           "SLURM_JOB_NODELIST": "n1"}
    assert detect_process(env).launcher == "openmpi"


@pytest.mark.parametrize(
    ("env", "pattern"),
    [
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK"),
        ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "x"}, "rank 4 is outside the world of 4"),
        ({"RANK": "a", "WORLD_SIZE": "4", "MASTER_ADDR": "x"}, "RANK='a' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "4"}, "MASTER_ADDR is not set"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "x"},
            "local rank 3",
        ),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "WORLD_SIZE": "4"}, "WORLD_SIZE=4 contradicts"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "99999"}, "not a TCP port"),
    ],
)
def test_contradictory_or_broken_variables(env: dict[str, str], pattern: str) -> None:
    with pytest.raises(ShardwiseError, match=pattern):
        detect_process(env)


def test_settings_are_read_once_into_the_runtime_env(tmp_path) -> None:
    from shardwise.runtime.settings import DEFAULT_HANG_TIMEOUT_S, read_settings

    env = {"RANK": "0", "WORLD_SIZE": "1", "SHARDWISE_CLUSTER": "h100", "SHARDWISE_CACHE_DIR": str(tmp_path),
           "SHARDWISE_FAULT": "rank=0,step=3", "SHARDWISE_HANG_TIMEOUT": "45", "TORCHELASTIC_RUN_ID": "job7",
           "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    settings = detect_process(env).settings
    assert settings == read_settings(env)
    assert (settings.cluster, settings.cache_dir, settings.fault, settings.hang_timeout_s) == (
        "h100",
        str(tmp_path),
        "rank=0,step=3",
        45.0,
    )
    assert (settings.run_id, settings.restart_count, settings.use_agent_store) == ("job7", 2, True)
    assert settings.attempt_namespace == "job7/2"
    bare = detect_process({}).settings
    assert bare.cluster is None and bare.hang_timeout_s == DEFAULT_HANG_TIMEOUT_S and bare.restart_count == 0
    assert read_settings({"XDG_CACHE_HOME": str(tmp_path)}).cache_dir == str(tmp_path / "shardwise")
    with pytest.raises(ShardwiseError, match="TORCHELASTIC_RESTART_COUNT"):
        read_settings({"TORCHELASTIC_RESTART_COUNT": "two"})


def test_one_runtime_env_type_from_detection_to_init() -> None:
    from shardwise.runtime.detect import RuntimeEnv

    info = detect_process({})
    assert type(info) is RuntimeEnv and info.device is None and info.backend == "" and info.is_main


def test_logger_names_keep_one_prefix() -> None:
    from shardwise.runtime.logging import get_logger

    assert get_logger("train").name == "shardwise.train"
    assert get_logger("shardwise.train.build").name == "shardwise.train.build"
    assert get_logger().name == "shardwise"
