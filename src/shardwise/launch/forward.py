"""The launcher's side of a pre-emption warning: pass SIGUSR1 on to the workers and keep supervising.

torch's elastic agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT itself: it sends the signal to
every worker, gives them ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30, like Slurm's
``KillWait`` and Kubernetes' grace period) and then SIGKILLs them. It does not handle SIGUSR1,
whose default action kills the process: a launcher hit by Slurm's time-limit warning used to die
at once and leave its workers behind.

:func:`forward_signals` installs a handler for SIGUSR1 in the launcher for the duration of a
launch. It records the signal and sends it to the launcher's child processes (the workers: the
agent starts each one with ``Popen``, in a session of its own). The agent keeps monitoring: the
workers save a checkpoint at their next step, return and exit 0, and the launch ends normally;
the caller then sees :attr:`Forwarded.received` and exits with ``128 + signal``. When the whole job
step is signalled (Slurm's ``--signal=USR1@N``) the workers get the signal twice, which is
harmless: a pre-emption request is a flag.

The handler is process-wide state for the duration of the ``with`` block only (signal handlers
belong to the process); the previous handler comes back afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Iterator

FORWARDED = (signal.SIGUSR1,)


def child_pids(pid: int | None = None) -> list[int]:
    """The direct children of ``pid`` (default: this process): from ``/proc`` on Linux, else ``pgrep -P``."""
    pid = os.getpid() if pid is None else pid
    children: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                children.update(int(c) for c in fh.read().split())
        return sorted(children)
    except OSError:
        pass
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted(int(c) for c in out.split() if c.isdigit())


@dataclass
class Forwarded:
    """What the launcher received during the launch (the first forwarded signal, if any). Mutable,
    unlike shardwise's other records: the signal handler fills it in while the launch runs."""

    received: int | None = None
    sent_to: list[int] = field(default_factory=list)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signum
        for pid in child_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
                self.sent_to.append(pid)


def forward_for_this_process(signals: tuple[int, ...] = FORWARDED) -> Forwarded:
    """Forward ``signals`` to this process's children from now until the process exits (main thread
    only). For a command's process (``shardwise run``, ``shardwise train``): a warning that arrives
    while it resolves its flags, or after its workers have exited and it is printing its summary,
    must not kill it either (it is recorded, and reaches whatever children there are)."""
    state = Forwarded()
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            signal.signal(sig, state._handle)
    return state


@contextlib.contextmanager
def forward_signals(signals: tuple[int, ...] = FORWARDED) -> Iterator[Forwarded]:
    """Forward ``signals`` to this process's children while the block runs (main thread only;
    elsewhere nothing is installed and the signals keep their default action)."""
    state = Forwarded()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    previous = {sig: signal.signal(sig, state._handle) for sig in signals}
    try:
        yield state
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
