"""The c10d rendezvous store on a host that does not train (``shardwise rendezvous``, ``--rdzv-store``).

torch's c10d rendezvous keeps the whole rendezvous state (who is in which round, every agent's
heartbeat) in one ``TCPStore``. By default the first agent hosts it, so losing that node ends
the job. Hosted by a process that trains nothing (a login node, the machine that runs ``shardwise
run --hostfile``), no training node is special: any of them may be lost and the rest re-form the
world. The agents reach it as clients (``--rdzv-endpoint HOST:PORT --rdzv-conf is_host=0``).

This is torch's own store, hosted on its own: the protocol, the state and the rendezvous logic are
torch's. The store holds a few kilobytes and answers a heartbeat per node every few seconds, so
any machine will do; it keeps no state on disk, and losing it ends the job (like losing the
storage of the checkpoints), which is why it belongs on a machine that is not pre-empted.
"""

from __future__ import annotations

import signal
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from shardwise.errors import LaunchError

DEFAULT_PORT = 29400  # torch's default c10d rendezvous port
MARK_KEY = "shardwise/rendezvous"  # set by the server: a client can tell it reached one


@dataclass(frozen=True)
class HostedStore:
    """A running store: keep the object alive as long as the job runs."""

    port: int
    store: Any  # torch.distributed.TCPStore (the server side)


def host_store(port: int = 0) -> HostedStore:
    """Start a ``TCPStore`` server on ``port`` of every address of this machine (0: a free port),
    or fail with one line when the port is taken."""
    import torch.distributed as dist  # here: the CLI parses flags without torch

    try:
        store = dist.TCPStore("0.0.0.0", port, is_master=True, multi_tenant=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
    except (RuntimeError, ValueError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise LaunchError(f"cannot serve the rendezvous store on port {port}: {first}",
                          hint="pick another --port (another process listens there)") from None
    store.set(MARK_KEY, "1")
    return HostedStore(port=store.port, store=store)


def parse_endpoint(text: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) of a running rendezvous store."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"{flag} {text!r} is not HOST:PORT", hint=f"for example {flag} login1:{DEFAULT_PORT}")
    return host, int(port)


def serve_forever(port: int, *, announce: bool = True) -> int:
    """``shardwise rendezvous``: host the store until SIGINT/SIGTERM; returns the exit code (0)."""
    hosted = host_store(port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if announce:
        name = socket.getfqdn()
        print(
            f"shardwise rendezvous: serving the c10d rendezvous store on port {hosted.port} of {name} (every address); "
            f"start each node with: shardwise run --nnodes MIN:MAX --rdzv-backend c10d --rdzv-endpoint "
            f"{name}:{hosted.port} --rdzv-conf is_host=0 --rdzv-id JOB --max-restarts N ...; stop with Ctrl-C",
            flush=True,
        )
    while not stop.wait(1.0):
        pass
    return 0
