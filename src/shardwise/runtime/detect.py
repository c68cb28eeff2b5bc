"""Find out who started this process and where it sits in the world.

Each launcher leaves its own environment variables; :func:`detect_process` turns them into one
typed :class:`RuntimeEnv` (the same type :func:`shardwise.init` completes with the device and
backend). Precedence, from most to least specific:

1. torchrun / the elastic agent / ``shardwise run`` / ``shardwise.launch``: ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.
2. OpenMPI (``mpirun``): ``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/NODE_RANK``.
3. MPICH, MVAPICH and Intel MPI: ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.
4. Slurm task of an ``srun`` step: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
   ``SLURM_NODEID``, ``SLURM_STEP_ID`` and the node list; the master is the list's first host.
5. Nothing: one process, world size 1.

An mpirun inside a Slurm allocation keeps Slurm's variables, so MPI wins over Slurm; a torchrun
worker inside either keeps theirs too, so torchrun's variables win over both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Mapping

from shardwise.errors import ShardwiseError
from shardwise.runtime.settings import Settings, read_settings
from shardwise.runtime.slurm import first_host

if TYPE_CHECKING:
    import torch

Launcher = Literal["torchrun", "openmpi", "mpich", "slurm", "none"]

DEFAULT_MASTER_PORT = 29500


DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RuntimeEnv:
    """This process's place in the world, and how it talks to the others.

    :func:`detect_process` fills in what the launcher says (``device`` None, ``backend`` empty);
    :func:`shardwise.init` adds the device and backend once the process group has formed, and that
    value is what every other layer takes as an argument. ``settings`` holds shardwise's own
    environment variables, read once (:mod:`shardwise.runtime.settings`).
    """

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    device: torch.device | None = None
    backend: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    settings: Settings = field(default_factory=Settings)

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the rank that logs, prints and writes single files."""
        return self.rank == 0

    @property
    def replica(self) -> int:
        """This process's fault-tolerant replica group (``shardwise run --ft-replicas``), else 0."""
        return self.settings.ft.replica if self.settings.ft is not None else 0

    @property
    def replicas(self) -> int:
        """The fault-tolerant replica groups the job was started with, else 1."""
        return self.settings.ft.replicas if self.settings.ft is not None else 1

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ShardwiseError(f"environment variable {name} is missing", hint="set it or unset its partners")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ShardwiseError(f"environment variable {name}={raw!r} is not an integer", hint="fix or unset it") from None


def _port(environ: Mapping[str, str], default: int) -> int:
    port = _int(environ, "MASTER_PORT", default)
    if not 0 < port < 65536:
        raise ShardwiseError(f"MASTER_PORT={port} is not a TCP port", hint="use a number between 1024 and 65535")
    return port


def _from_torchrun(env: Mapping[str, str]) -> RuntimeEnv:
    for name in ("RANK", "WORLD_SIZE"):
        if name not in env:
            other = "WORLD_SIZE" if name == "RANK" else "RANK"
            raise ShardwiseError(f"{other} is set but {name} is not", hint="set both (torchrun does) or neither")
    world = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    rank = _int(env, "RANK")
    local_rank = _int(env, "LOCAL_RANK", rank % max(local_world, 1))
    node_rank = _int(env, "GROUP_RANK", rank // max(local_world, 1))
    if world > 1 and "MASTER_ADDR" not in env:
        raise ShardwiseError(
            f"WORLD_SIZE={world} but MASTER_ADDR is not set",
            hint="start the job with 'shardwise run' or torchrun, or export MASTER_ADDR and MASTER_PORT",
        )
    return RuntimeEnv(
        launcher="torchrun",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=max(1, world // max(local_world, 1)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_port(env, DEFAULT_MASTER_PORT),
    )


def _mpi_master(env: Mapping[str, str], world: int, local_world: int, launcher: str) -> str:
    if "MASTER_ADDR" in env:
        return env["MASTER_ADDR"]
    if world == local_world:  # every rank on this host
        return "127.0.0.1"
    raise ShardwiseError(
        f"{launcher} started {world} ranks on several hosts but MASTER_ADDR is not set",
        hint="pass '-x MASTER_ADDR=<first host>' to mpirun (or export it) so the ranks can meet",
    )


def _from_openmpi(env: Mapping[str, str]) -> RuntimeEnv:
    world = _int(env, "OMPI_COMM_WORLD_SIZE")
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", rank % local_world)
    node_rank = _int(env, "OMPI_COMM_WORLD_NODE_RANK", rank // local_world)
    return RuntimeEnv(
        launcher="openmpi",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=max(1, -(-world // local_world)),
        master_addr=_mpi_master(env, world, local_world, "mpirun (OpenMPI)"),
        master_port=_port(env, DEFAULT_MASTER_PORT),
    )


def _from_mpich(env: Mapping[str, str]) -> RuntimeEnv:
    world = _int(env, "PMI_SIZE")
    rank = _int(env, "PMI_RANK")
    local_world = _int(env, "MPI_LOCALNRANKS", world)
    local_rank = _int(env, "MPI_LOCALRANKID", rank % local_world)
    return RuntimeEnv(
        launcher="mpich",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=rank // local_world,
        num_nodes=max(1, -(-world // local_world)),
        master_addr=_mpi_master(env, world, local_world, "mpirun (MPICH/Intel MPI)"),
        master_port=_port(env, DEFAULT_MASTER_PORT),
    )


def slurm_nodelist(env: Mapping[str, str]) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            return env[name]
    raise ShardwiseError("Slurm variables are set but no node list is", hint="run inside an srun step")


def slurm_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT, or a port derived from the job id so two jobs on one node do not collide."""
    job = env.get("SLURM_JOB_ID", "")
    return _port(env, 15000 + int(job) % 20000 if job.isdigit() else DEFAULT_MASTER_PORT)


def _from_slurm(env: Mapping[str, str]) -> RuntimeEnv:
    world = _int(env, "SLURM_NTASKS")
    rank = _int(env, "SLURM_PROCID")
    num_nodes = _int(env, "SLURM_NNODES", _int(env, "SLURM_JOB_NUM_NODES", 1))
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    local_world = int(per_node) if per_node.isdigit() else max(1, world // max(num_nodes, 1))
    return RuntimeEnv(
        launcher="slurm",
        rank=rank,
        world_size=world,
        local_rank=_int(env, "SLURM_LOCALID", rank % local_world),
        local_world_size=local_world,
        node_rank=_int(env, "SLURM_NODEID", rank // local_world),
        num_nodes=num_nodes,
        master_addr=env.get("MASTER_ADDR") or first_host(slurm_nodelist(env)),
        master_port=slurm_port(env),
    )


def _validate(info: RuntimeEnv, env: Mapping[str, str]) -> RuntimeEnv:
    src = {"torchrun": "RANK/WORLD_SIZE", "openmpi": "OMPI_COMM_WORLD_*", "mpich": "PMI_*", "slurm": "SLURM_*"}
    where = src.get(info.launcher, info.launcher)
    if info.world_size < 1:
        raise ShardwiseError(
            f"world size {info.world_size} from {where} is not positive", hint="fix the launcher variables"
        )
    if not 0 <= info.rank < info.world_size:
        raise ShardwiseError(
            f"rank {info.rank} is outside the world of {info.world_size} ({where})",
            hint="the rank must be in [0, world size); check for stale exported variables",
        )
    if not 0 <= info.local_rank < info.local_world_size:
        raise ShardwiseError(
            f"local rank {info.local_rank} is outside the local world of {info.local_world_size} ({where})",
            hint="check LOCAL_RANK / LOCAL_WORLD_SIZE for stale exported values",
        )
    if info.launcher != "torchrun" and "WORLD_SIZE" in env and _int(env, "WORLD_SIZE") != info.world_size:
        raise ShardwiseError(
            f"WORLD_SIZE={env['WORLD_SIZE']} contradicts the {info.world_size} ranks that {info.launcher} started",
            hint="unset WORLD_SIZE (and RANK) or make them agree",
        )
    return info


def detect_process(environ: Mapping[str, str]) -> RuntimeEnv:
    """Read the launcher's variables from ``environ`` (usually ``os.environ``)."""
    env = environ
    if "RANK" in env or ("WORLD_SIZE" in env and not _mpi_or_slurm(env)):
        info = _from_torchrun(env)
    elif "OMPI_COMM_WORLD_RANK" in env:
        info = _from_openmpi(env)
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        info = _from_mpich(env)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        info = _from_slurm(env)
    else:
        info = RuntimeEnv("none", 0, 1, 0, 1, 0, 1, "127.0.0.1", 0)
    return replace(_validate(info, env), settings=read_settings(env))


def _mpi_or_slurm(env: Mapping[str, str]) -> bool:
    return "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env or ("SLURM_PROCID" in env and "SLURM_STEP_ID" in env)
