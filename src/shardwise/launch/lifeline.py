"""``shardwise run --stop-with-stdin``: the remote half of a multi-host launch dies with its ssh session.

The launching machine keeps the write end of each session's stdin. That end closes when the
launcher stops the job (Ctrl-C, a failed host), when the launcher itself dies (even by SIGKILL:
the kernel closes its pipes), when the ssh client dies, or when the network drops the connection
(sshd then closes the session). In every case the remote ``shardwise run`` reads end-of-file on
its stdin, and this thread stops the node:

1. SIGTERM to this process: torch's elastic agent catches it and stops its workers the way it
   always does (SIGTERM, then SIGKILL after 30 s; a Trainer with checkpoints saves at the next
   step boundary, see ``shardwise.checkpoint.signals``);
2. if anything is still alive ``grace_s`` later, SIGKILL to every child's process group (each
   worker leads its own, the agent starts them with ``start_new_session``) and to this process.

So no remote process outlives its session, and no daemon is left behind: nothing here runs
longer than the ``shardwise run`` it belongs to.
"""

from __future__ import annotations

import os
import signal
import threading
import time

DEFAULT_GRACE_S = 45.0  # the agent's own SIGTERM -> SIGKILL wait is 30 s


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from ``/proc``; empty where there is none, e.g. macOS)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _kill_all(pid: int) -> None:
    for child in children(pid):
        for kill in (lambda: os.killpg(child, signal.SIGKILL), lambda: os.kill(child, signal.SIGKILL)):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass
    os.kill(pid, signal.SIGKILL)


def _watch(fd: int, grace_s: float) -> None:
    try:
        while os.read(fd, 4096):
            pass  # the launcher never writes; anything read is ignored
    except OSError:
        pass
    me = os.getpid()
    os.kill(me, signal.SIGTERM)
    time.sleep(grace_s)
    _kill_all(me)


def stop_with_stdin(grace_s: float = DEFAULT_GRACE_S, fd: int = 0) -> threading.Thread:
    """Start the watcher thread (a daemon: a normal exit of the process is never held up by it)."""
    thread = threading.Thread(target=_watch, args=(fd, grace_s), name="shardwise-stdin-lifeline", daemon=True)
    thread.start()
    return thread
