"""Leave when the launcher is gone: a worker whose launcher died must not live on as an orphan.

The elastic agent starts every worker in a session of its own, so nothing stops a worker whose
launcher was SIGKILLed, crashed or was killed for memory: such workers used to keep running,
logging ``TCPStore ... Broken pipe`` as they tried to reach the store that lived in the launcher.

:func:`watch_launcher` starts one daemon thread (process-wide, like the hang watchdog) that checks
once a second whether the launcher is still this process's parent. When it is not, it does what
the launcher would have done on a SIGTERM: it sends this process SIGTERM, and if the process is
still alive ``grace_s`` seconds later (the agent's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30)
it ends it. SIGTERM is the pre-emption signal: a worker inside ``Trainer.fit`` saves a checkpoint
at its next step (the ranks reach each other directly; the checkpoint collectives need no store)
and returns; a worker anywhere else ends at once by SIGTERM's default action, or soon after by the
deadline. The parent is polled, rather than asked of the kernel (``PR_SET_PDEATHSIG``), because
the same thread then also bounds how long the worker may take.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

POLL_S = 1.0
ORPHAN_EXIT_CODE = 128 + signal.SIGTERM  # as if the launcher's SIGTERM-then-SIGKILL had ended it


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(launcher_pid: int, grace_s: float) -> None:
    is_parent = os.getppid() == launcher_pid
    while (os.getppid() == launcher_pid) if is_parent else _alive(launcher_pid):
        time.sleep(POLL_S)
    print(f"[shardwise] launcher (pid {launcher_pid}) is gone: stopping this worker (pid {os.getpid()}) "
          f"with SIGTERM, at most {grace_s:.0f} s to save", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    print(f"[shardwise] worker (pid {os.getpid()}) still running {grace_s:.0f} s after its launcher died: exiting",
          file=sys.stderr, flush=True)
    os._exit(ORPHAN_EXIT_CODE)


def watch_launcher(launcher_pid: int, *, grace_s: float = 30.0) -> threading.Thread:
    """Stop this process (SIGTERM, then an exit after ``grace_s``) once ``launcher_pid`` has exited,
    or at once if it already has. Returns the watching thread (a daemon)."""
    thread = threading.Thread(target=_watch, args=(launcher_pid, grace_s), name="shardwise-launcher-watch", daemon=True)
    thread.start()
    return thread
