"""Start and stop this process's part of the distributed world.

:func:`init` reads the launcher (see :mod:`shardwise.runtime.detect`), picks the backend and the
device, and forms the default process group. It returns a frozen :class:`~shardwise.runtime.detect.RuntimeEnv`
that every other layer takes as an argument; shardwise's own variables are read into its
``settings`` at the same moment, and no layer reads the environment again after this.

Backend: NCCL when CUDA devices are present (one device per local rank, ``cuda:local_rank``),
Gloo otherwise. A world of one still gets a (one-member) process group so that DeviceMesh,
DTensor and FSDP work unchanged in a single process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from dataclasses import replace
from datetime import timedelta
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from shardwise.errors import LaunchError, ShardwiseError
from shardwise.runtime.detect import DEFAULT_TIMEOUT_S, RuntimeEnv, detect_process
from shardwise.runtime.logging import setup_logging
from shardwise.runtime.parent import watch_launcher
from shardwise.runtime.watchdog import enable_flight_recorder, start_watchdog, stop_watchdog


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
        raise ShardwiseError(
            "backend 'nccl' needs CUDA devices and none are visible", hint="use backend='gloo' on CPUs"
        )
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
    watchdog of :mod:`shardwise.runtime.watchdog` in a multi-process world: a collective or step
    without progress for that long makes every rank report and exit non-zero.
    """
    environ = os.environ if environ is None else environ
    info = detect_process(environ)
    if dist.is_initialized():
        backend = dist.get_backend()
        return replace(info, device=_device_for(backend, info.local_rank), backend=backend, timeout_s=timeout_s)
    if info.settings.launcher_pid is not None:
        # Started by ``shardwise run``: leave (after a pre-emption save) if the launcher dies.
        _watch_launcher_once(info.settings.launcher_pid, info.settings.stop_grace_s)
    chosen = choose_backend(backend)
    hang_s = info.settings.hang_timeout_s if hang_timeout_s is None else hang_timeout_s
    if hang_s > 0:
        enable_flight_recorder(os.environ, chosen)  # read by torch when the group forms
    device = _device_for(chosen, info.local_rank)
    timeout = timedelta(seconds=timeout_s)
    try:
        if info.launcher == "torchrun":
            # The elastic agent keeps one store for the whole job, across restarts. Keys from a
            # failed attempt (e.g. Gloo's peer addresses) must not leak into the next one, so each
            # attempt gets its own key prefix.
            store = dist.TCPStore(
                info.master_addr, info.master_port, world_size=info.world_size,
                is_master=not info.settings.use_agent_store and info.rank == 0, timeout=timeout,
            )
            init_kwargs = {"store": dist.PrefixStore(f"shardwise/attempt/{info.settings.attempt_namespace}", store)}
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
    setup_logging(
        info.rank, info.world_size, level=logging.DEBUG if info.settings.log_level == "debug" else logging.INFO
    )
    if hang_s > 0 and info.world_size > 1:
        start_watchdog(
            rank=info.rank, world_size=info.world_size, timeout_s=hang_s, namespace=info.settings.attempt_namespace
        )
    return replace(info, device=device, backend=chosen, timeout_s=timeout_s)


def _watch_launcher_once(launcher_pid: int, grace_s: float) -> None:
    if not any(t.name == "shardwise-launcher-watch" and t.is_alive() for t in threading.enumerate()):
        watch_launcher(launcher_pid, grace_s=grace_s)


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
