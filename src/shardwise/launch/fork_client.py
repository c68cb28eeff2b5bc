"""A worker's stand-in under a fork server: what the elastic agent starts when ``SHARDWISE_FORKSERVER`` is set.

``python -I -S fork_client.py SOCKET ARGS...`` is started by the agent where it would start
``python ARGS...`` (:func:`shardwise.launch.options.resolve`). It imports only the standard library
(a few milliseconds), connects to the fork server at ``SOCKET`` (:mod:`shardwise.launch.forkserver`),
hands it ``ARGS``, its environment, working directory and its stdin/stdout/stderr (the descriptors
themselves, ``SCM_RIGHTS``), and then stands for the worker the server forked:

- every signal the agent sends it (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) is passed
  on to the worker; if it is SIGKILLed, its connection closes and the server SIGKILLs the worker;
- it exits as the worker did: the same exit code, or killed by the same signal.

When no server answers at ``SOCKET``, it becomes the worker the usual way (``exec python ARGS``),
so a stale or missing server costs one failed ``connect``, never a run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _exec_fresh(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *args])


def _exit_as(status: int) -> None:
    """Exit with ``status`` (the worker's ``waitstatus_to_exitcode``: negative for a signal)."""
    sys.stdout.flush()
    if status < 0:
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose action cannot be changed
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status if status >= 0 else 128 - status)


def main(argv: list[str]) -> None:
    path, args = argv[0], argv[1:]
    if not args or not (args[0] == "-m" or args[0].endswith(".py")):  # other interpreter flags: python itself
        _exec_fresh(args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        _exec_fresh(args)
        return
    request = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])

    def pass_on(signum: int, _frame: object) -> None:
        try:
            conn.sendall(f"{signum}\n".encode())
        except OSError:
            pass

    for signum in PASSED_ON:
        signal.signal(signum, pass_on)
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            print(f"shardwise: the fork server at {path} went away before the worker ended", file=sys.stderr)
            os._exit(1)
        answer += chunk
    _exit_as(int(answer))


if __name__ == "__main__":
    main(sys.argv[1:])
