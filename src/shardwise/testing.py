"""Run test functions on several real processes: the harness every multi-process test uses.

:class:`WorkerPool` spawns ``world_size`` processes once, forms one Gloo process group on
loopback, and then runs any number of functions on all of them: ``pool.run(fn, *args)`` returns
the list of per-rank results. Reusing the processes saves the ~2 s interpreter and torch start-up
per rank per test, which is what keeps a suite of hundreds of multi-process tests fast.

Failure handling:

- a rank that raises: its traceback is raised in the caller as :class:`RankFailed`, the other
  ranks get a short grace period, then the pool is torn down and rebuilt for the next call;
- a call that exceeds its hard timeout: every stuck rank dumps its Python stack (faulthandler),
  the pool is killed, and :class:`RanksTimedOut` names the ranks that did not finish;
- workers watch their parent and exit if it dies, so no orphan processes are left.

Start-up: ``start_method="spawn"`` (the default) starts each rank as a fresh interpreter that
imports torch itself (1.5-2 CPU-seconds a rank, each time a pool starts or recovers);
``start_method="forkserver"`` with ``preload=("torch", ...)`` forks the ranks from one server
process that imported those modules once (Python's forkserver; :func:`multiprocessing.set_forkserver_preload`),
so a rank starts in milliseconds. Either way a rank gets this process's environment and working
directory as they are when the pool starts, and every call's ``sys.path`` entries.

Functions must be importable (module-level), and must not destroy the default process group.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

_GRACE_S = 3.0


class RankFailed(AssertionError):
    """A rank raised; the message holds its traceback."""


class RanksTimedOut(AssertionError):
    """Some ranks did not finish within the hard timeout."""


def _watch_parent(parent_pid: int) -> None:
    """Exit when the pool's process is gone, or the process that started this one (the pool's
    process itself, or its fork server, which ends with it)."""
    started_by = os.getppid()
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:
            pass
        if os.getppid() != started_by:
            os._exit(3)
        time.sleep(0.5)


def _worker_main(rank: int, world_size: int, port: int, conn: Connection, parent_pid: int, threads: int,
                 env: dict[str, str] | None = None, cwd: str | None = None) -> None:
    if env is not None:  # the pool's process's, as spawn gives them (a fork server's are from when it started)
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    conn.send_bytes(pickle.dumps(("ok", "ready", 1)))
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            break
        fn, args, kwargs, path = pickle.loads(message)
        if fn is None:
            break
        for entry in path:
            if entry not in sys.path:
                sys.path.append(entry)
        try:
            reply = ("ok", fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - everything is reported to the caller
            reply = ("err", traceback.format_exc())
        # How many process groups this worker holds: the pool recycles itself past a limit.
        reply = (*reply, len(dist.distributed_c10d._world.pg_map))
        try:
            conn.send_bytes(pickle.dumps(reply))
        except Exception:  # noqa: BLE001 - an unpicklable result is a test error too
            conn.send_bytes(pickle.dumps(("err", traceback.format_exc(), 0)))
    # Leave without destroy_process_group(): tearing down Gloo's groups waits on the other ranks
    # (seconds per pool, each time one closes or recycles), and the process is ending anyway.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerPool:
    """``world_size`` spawned processes sharing one Gloo process group (see the module doc)."""

    def __init__(self, world_size: int, *, timeout_s: float = 120.0, threads_per_rank: int = 1, max_groups: int = 48,
                 start_method: str = "spawn", preload: tuple[str, ...] = ()) -> None:
        self.world_size = world_size
        self.start_method = start_method
        self.preload = preload
        self.max_groups = max_groups
        self._groups = 0
        self.timeout_s = timeout_s
        self.threads_per_rank = threads_per_rank
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []

    # -- lifecycle -------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver" and self.preload:
            ctx.set_forkserver_preload(list(self.preload))  # read when the server starts: once per process
        port = _free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world_size,
                    port,
                    child,
                    os.getpid(),
                    self.threads_per_rank,
                    dict(os.environ),
                    os.getcwd(),
                ),
                name=f"shardwise-test-rank{rank}",
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(deadline=time.monotonic() + 120.0, what="start-up")

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps((None, (), {}, [])))
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=5)
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._groups = [], [], 0

    # -- running ---------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank."""
        if not self._procs:
            self._start()
        payload = pickle.dumps((fn, args, kwargs, list(sys.path)))
        for conn in self._conns:
            conn.send_bytes(payload)
        return self._collect(
            deadline=time.monotonic() + (timeout_s or self.timeout_s), what=getattr(fn, "__name__", "call")
        )

    def _collect(self, deadline: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        first_error_at = 0.0  # set with the first error; the others get _GRACE_S more to report theirs
        while pending:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, first_error_at + _GRACE_S)
            if now >= deadline:
                break
            ready = wait(list(pending.values()), timeout=min(0.5, deadline - now))
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        status, value, groups = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        status, value, groups = "err", f"rank {rank} died (exit code {self._procs[rank].exitcode})", 0
                    self._groups = max(self._groups, groups)
                    del pending[rank]
                    if status == "ok":
                        results[rank] = value
                    elif status == "err":
                        if not errors:
                            first_error_at = time.monotonic()
                        errors[rank] = value
            for rank in list(pending):
                if not self._procs[rank].is_alive() and not self._conns[rank].poll():
                    del pending[rank]
                    if not errors:
                        first_error_at = time.monotonic()
                    errors[rank] = f"rank {rank} died (exit code {self._procs[rank].exitcode})"
        if errors or pending:
            stuck = sorted(pending)
            if stuck and not errors:
                for rank in stuck:  # ask each stuck rank for its Python stack before killing it
                    try:
                        os.kill(self._procs[rank].pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
                time.sleep(1.0)
            self._kill()
            if errors:
                first = min(errors)
                others = f" (ranks {stuck} did not finish)" if stuck else ""
                raise RankFailed(f"{what}: rank {first} failed{others}:\n{errors[first]}")
            raise RanksTimedOut(
                f"{what}: ranks {stuck} did not finish in time; their stacks are in the captured stderr"
            )
        if self._groups > self.max_groups:
            # Each Gloo group keeps its own connection threads, and DeviceMesh caches groups by
            # name, so they cannot be destroyed one by one. Hundreds of them mean thousands of
            # polling threads per worker that starve the host: start fresh processes instead.
            self.close()
        return [results[r] for r in range(self.world_size)]


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn`` once on a fresh pool of ``world_size`` processes (for tests that need a new world)."""
    pool = WorkerPool(world_size, timeout_s=timeout_s)
    try:
        return pool.run(fn, *args, **kwargs)
    finally:
        pool.close()
