"""Start and stop this process's part of the distributed world.

:func:`init` reads the launcher (see :mod:`shardwise.runtime.detect`), picks the backend and the
device, and forms the default process group. It returns a frozen :class:`RuntimeEnv` that every
other layer takes as an argument; nothing reads the environment again after this.

Backend: NCCL when CUDA devices are present (one device per local rank, ``cuda:local_rank``),
Gloo otherwise. A world of one still gets a (one-member) process group so that DeviceMesh,
DTensor and FSDP work unchanged in a single process.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from shardwise.errors import LaunchError, ShardwiseError
from shardwise.observe.watchdog import enable_flight_recorder, hang_timeout_from_env, start_watchdog, stop_watchdog
from shardwise.runtime.detect import Launcher, ProcessInfo, detect_process
from shardwise.runtime.logging import setup_logging

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RuntimeEnv:
    """This process's place in the world, and how it talks to the others."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    device: torch.device
    backend: str
    launcher: Launcher
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the rank that logs, prints and writes single files."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def choose_backend(requested: str | None) -> str:
    """``requested`` if given and available, else NCCL with CUDA and Gloo without."""
    if requested is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    name = requested.lower()
    if name == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ShardwiseError("backend 'nccl' needs CUDA devices and none are visible", hint="use backend='gloo' on CPUs")
    if name == "gloo" and not dist.is_gloo_available():
        raise ShardwiseError("backend 'gloo' is not built into this torch", hint="install a torch build with Gloo")
    if name not in ("nccl", "gloo", "mpi", "xccl") and ":" not in name:
        raise ShardwiseError(f"unknown backend {requested!r}", hint="use 'nccl', 'gloo' or 'mpi'")
    return name


def _device_for(backend: str, local_rank: int) -> torch.device:
    if "nccl" in backend:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ShardwiseError(
                f"local rank {local_rank} has no GPU: only {count} visible on this host",
                hint="start at most one process per GPU (--nproc-per-node) or check CUDA_VISIBLE_DEVICES",
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _env_from_group(backend: str, timeout_s: float, launcher: Launcher, info: ProcessInfo) -> RuntimeEnv:
    return RuntimeEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=info.local_rank,
        local_world_size=info.local_world_size,
        node_rank=info.node_rank,
        num_nodes=info.num_nodes,
        device=_device_for(backend, info.local_rank),
        backend=backend,
        launcher=launcher,
        timeout_s=timeout_s,
    )


def init(
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    environ: Mapping[str, str] | None = None,
    hang_timeout_s: float | None = None,
) -> RuntimeEnv:
    """Detect the launcher, form the default process group and bind this process's device.

    Calling it again in an initialized process returns the same description without re-forming
    the group. ``timeout_s`` bounds both the rendezvous and every collective.

    ``hang_timeout_s`` (default: ``SHARDWISE_HANG_TIMEOUT``, else 300 s; 0 disables) starts the hang
    watchdog of :mod:`shardwise.observe.watchdog` in a multi-process world: a collective or step
    without progress for that long makes every rank report and exit non-zero.
    """
    info = detect_process(os.environ if environ is None else environ)
    if dist.is_initialized():
        return _env_from_group(dist.get_backend(), timeout_s, info.launcher, info)
    chosen = choose_backend(backend)
    hang_s = hang_timeout_from_env(os.environ if environ is None else environ) if hang_timeout_s is None else hang_timeout_s
    if hang_s > 0:
        enable_flight_recorder(os.environ, chosen)  # read by torch when the group forms
    environ = os.environ if environ is None else environ
    device = _device_for(chosen, info.local_rank)
    timeout = timedelta(seconds=timeout_s)
    try:
        if info.launcher == "torchrun":
            # The elastic agent keeps one store for the whole job, across restarts. Keys from a
            # failed attempt (e.g. Gloo's peer addresses) must not leak into the next one, so each
            # attempt gets its own key prefix.
            agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(
                info.master_addr, info.master_port, world_size=info.world_size,
                is_master=not agent_store and info.rank == 0, timeout=timeout,
            )
            attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            init_kwargs = {"store": dist.PrefixStore(f"shardwise/attempt_{attempt}", store)}
        elif info.world_size == 1:
            init_kwargs = {"init_method": f"tcp://127.0.0.1:{_free_port()}"}
        else:
            init_kwargs = {"init_method": f"tcp://{info.master_addr}:{info.master_port}"}
        dist.init_process_group(
            backend=chosen,
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            **init_kwargs,
        )
    except (RuntimeError, ValueError, TimeoutError, OSError) as exc:
        raise LaunchError(
            f"rank {info.rank} could not join the process group at {info.master_addr}:{info.master_port} "
            f"within {timeout_s:.0f}s ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
            hint="check that MASTER_ADDR is reachable from every node, the port is open and all ranks started",
        ) from exc
    setup_logging(info.rank, info.world_size)
    if hang_s > 0 and info.world_size > 1:
        start_watchdog(rank=info.rank, world_size=info.world_size, timeout_s=hang_s)
    return RuntimeEnv(
        rank=info.rank,
        world_size=info.world_size,
        local_rank=info.local_rank,
        local_world_size=info.local_world_size,
        node_rank=info.node_rank,
        num_nodes=info.num_nodes,
        device=device,
        backend=chosen,
        launcher=info.launcher,
        timeout_s=timeout_s,
    )


def shutdown() -> None:
    """Destroy the default process group if there is one (safe to call twice)."""
    stop_watchdog()  # waits (bounded) until every rank finished, so an early finisher is named
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """All ranks wait here; a no-op without a process group."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@contextlib.contextmanager
def main_process_first(env: RuntimeEnv) -> Iterator[None]:
    """Rank 0 runs the block first (download, cache, tokenize), then the others run it.

    Communication: two barriers over the whole world.
    """
    if not env.is_main:
        barrier()
    try:
        yield
    finally:
        if env.is_main:
            barrier()
