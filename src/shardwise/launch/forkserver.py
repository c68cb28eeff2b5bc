"""A fork server for workers: pay for ``import torch`` once, start every worker in milliseconds.

A worker of ``shardwise run`` or ``shardwise train`` spends its first 2-5 CPU-seconds importing
torch, DTensor, DCP and shardwise (and transformers for ``--model.hf``), each time it starts: at
every launch, on every restart. ``python -m shardwise.launch.forkserver --socket PATH`` imports
them once and waits; with ``SHARDWISE_FORKSERVER=PATH`` in the launcher's environment, the elastic
agent starts :mod:`shardwise.launch.fork_client` instead of ``python``, which asks this server for
the worker. Everything else is unchanged: the same agent, rendezvous, environment, signals and exit
codes.

Per request (one connection), the server forks a *keeper*, which forks the *worker*:

- the worker takes the client's stdin/stdout/stderr, working directory, environment and argv
  (``-m MODULE ARGS`` or ``SCRIPT ARGS``), starts a session of its own (as the agent's workers
  do), sets torch's thread count from ``OMP_NUM_THREADS`` (read by OpenMP at start-up, which was
  the server's), takes the warning filters its own ``PYTHONWARNINGS`` gives (with those the
  server's imports added: :mod:`shardwise.launch.fork_warnings`) and runs the target as
  ``python`` would, up to the interpreter's normal exit;
- the keeper passes on the signals the client receives and answers the worker's exit status; when
  the client is gone (SIGKILLed with the rest of its job), it SIGKILLs the worker.

Fork safety: the server only imports; it runs no torch operation (no OpenMP pool, no thread, no
process group) before it forks. A module read at import time is the server's: start it with the
environment the workers share (``PYTHONPATH``, ``OMP_NUM_THREADS``).

The server exits when its parent does (checked once a second) and removes its socket.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Mapping

from shardwise.launch.fork_warnings import StartupFilters
from shardwise.runtime.quiet import quiet_while

FORKSERVER_VAR = "SHARDWISE_FORKSERVER"
CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fork_client.py")
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "torch.distributed.elastic.multiprocessing.errors", "torch._dynamo",
           "shardwise.launch.worker_main", "shardwise.runtime.env", "shardwise.train", "shardwise.parallel",
           "shardwise.checkpoint.manager", "shardwise.jobs.train")


def worker_command(args: list[str], environ: Mapping[str, str]) -> list[str]:
    """The arguments of ``python`` that start the worker ``python ARGS``: through the fork client
    when ``environ`` names a server (``SHARDWISE_FORKSERVER``), else ``ARGS`` themselves."""
    path = environ.get(FORKSERVER_VAR)
    return ["-I", "-S", CLIENT, path, *args] if path else list(args)


@dataclass(frozen=True)
class WorkerRequest:
    """What a client asks for: ``python argv`` in ``cwd`` with ``env``."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


def _receive(conn: socket.socket) -> tuple[WorkerRequest, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    size = int.from_bytes(data[:8], "big")
    body = data[8:]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the client closed its connection mid-request")
        body += chunk
    fields = json.loads(body)
    return WorkerRequest(argv=list(fields["argv"]), env=dict(fields["env"]), cwd=str(fields["cwd"])), list(fds)


def _pass_signals(conn: socket.socket, pid: int, done: threading.Event) -> None:
    """Keeper: each line from the client is a signal for the worker; the end of the connection
    (the client killed) kills the worker."""
    with contextlib.suppress(ProcessLookupError):  # the worker ended (and was reaped) meanwhile
        with conn.makefile("rb") as lines:
            for line in lines:
                if not done.is_set():
                    os.kill(pid, int(line))
        if not done.is_set():
            os.kill(pid, signal.SIGKILL)


def _keep(conn: socket.socket) -> WorkerRequest:
    """Keeper (a child of the server): fork the worker, then stand by it; returns the request in the
    worker, never in the keeper (which exits)."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request, fds = _receive(conn)
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        return request
    for fd in fds:
        os.close(fd)
    done = threading.Event()
    threading.Thread(target=_pass_signals, args=(conn, pid, done), daemon=True).start()
    _, status = os.waitpid(pid, 0)
    done.set()
    try:
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass
    os._exit(0)


def _reap(_signum: int, _frame: object) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve(path: str, preload: tuple[str, ...]) -> WorkerRequest:
    """Import ``preload``, listen at ``path`` and fork per request. Returns only in a worker."""
    with quiet_while(os.environ):  # the dependencies' import noise; each worker quiets (or not) for itself
        for name in preload:
            try:
                importlib.import_module(name)
            except ImportError:  # an optional dependency that is not installed: its workers import nothing more
                pass
    # What was imported lives as long as every worker: out of the collector's sight (gc.freeze), a
    # worker's collections, up to the last one at its exit, no longer walk (and so copy, page by page)
    # the whole inherited heap: with torch and transformers loaded, a worker that does nothing ends
    # in 0.4 CPU-seconds and 0.6 s instead of 2 CPU-seconds and 3.7 s.
    gc.freeze()
    parent, server = os.getppid(), os.getpid()
    signal.signal(signal.SIGCHLD, _reap)  # waited for, so their CPU time adds to this process's (children)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path + ".tmp"):  # left by a server that was killed while binding
        os.unlink(path + ".tmp")
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # clients connect only once the imports are done
    listener.listen(128)
    listener.settimeout(1.0)
    try:
        while os.getppid() == parent:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.setblocking(True)
            if os.fork() == 0:
                listener.close()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                try:
                    return _keep(conn)
                except BaseException:  # noqa: BLE001 - a keeper whose client left mid-request
                    os._exit(1)
            conn.close()
    finally:
        if os.getpid() == server:
            listener.close()
            if os.path.exists(path):
                os.unlink(path)
    sys.exit(0)


def _stdio() -> None:
    """Fresh ``sys.stdin/stdout/stderr`` on descriptors 0-2, as the interpreter makes them at start-up."""
    write_through = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1 if os.isatty(1) else -1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    if write_through:
        sys.stdout.reconfigure(write_through=True)


def run_worker(request: WorkerRequest, startup: StartupFilters) -> None:
    """Become ``python *request.argv`` (``-m MODULE ...`` or ``SCRIPT ...``) in this forked process."""
    os.setsid()
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    startup.apply(request.env)  # the warning filters of its own PYTHONWARNINGS
    _stdio()
    for entry in reversed(request.env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(1, entry)
    threads = request.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    from shardwise.launch.worker_main import run_as_main

    module = request.argv[0] == "-m"
    target, *rest = request.argv[1:] if module else request.argv
    sys.argv = [target, *rest]
    sys.path[0] = os.getcwd()  # python -m's first entry (run_as_main puts a file's directory there)
    run_as_main(target, module=module)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shardwise.launch.forkserver", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the Unix socket to listen at (SHARDWISE_FORKSERVER)")
    parser.add_argument("--preload", default=",".join(PRELOAD), help="comma-separated modules to import once")
    args = parser.parse_args(argv)
    startup = StartupFilters.now()  # before the imports (shardwise.launch.fork_warnings)
    request = serve(args.socket, tuple(name for name in args.preload.split(",") if name))
    run_worker(request, startup)


if __name__ == "__main__":
    main()
