"""Run many short commands fast: one process imports torch and shardwise once, then forks a child
per command (``python -m tests.forkrun`` reads the jobs as JSON on stdin, answers JSON on stdout).

A ``shardwise`` command started the usual way spends most of a short run importing torch and
shardwise (4-5 CPU-seconds); a child forked from a process that has imported them starts in
milliseconds. Nothing has run in the parent (no thread, no OpenMP pool, no process group), so the
fork is safe; each child gets its own session (so a timeout kills it with everything it started),
working directory, environment, and stdout/stderr files, then runs ``shardwise.cli.main(argv)``
(or a Python file, or a function), exactly what the command's entry point does. Processes a
command starts (the workers of ``shardwise run``) are new interpreters, or fork from the session's
server where the environment names one (tests/worker_forkserver.py).

A job: ``{"id", "kind": "shardwise"|"python"|"call", "argv", "cwd", "env", "stdout", "stderr",
"timeout_s"}`` (``call``: ``argv = [module, function, *args]``; a ``python`` job's ``"executable"``
is its script's ``sys.executable``, the ``python`` it starts); ``"unprivileged": true`` runs it, as
root, subject to file permissions (:func:`drop_permission_override`). Jobs run ``parallel`` at a time,
longest expected first (``"cost"``); the answer maps each id to ``{"rc", "seconds", "cpu_s"}``
(``rc`` is ``"timeout"`` when it was killed; ``cpu_s``: the CPU time of the command and of the
processes it waited for).

:func:`run_phases` starts a server for one batch of phases; :class:`Zygote` keeps one running for
many batches (``python -m tests.forkrun --serve``: one JSON request a line on stdin, one JSON answer
a line on stdout), so a test session pays the imports once however many commands it runs.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

# what a `shardwise train` run imports (run_phases(preload=...) adds what other commands need)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.elastic.multiprocessing", "torch.distributed.launcher.api",
           "shardwise.cli", "shardwise.train", "shardwise.parallel", "shardwise.jobs.train", "shardwise.launch.run",
           "shardwise.checkpoint.manager", "matplotlib.pyplot")


PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2  # <linux/prctl.h>, <linux/capability.h>
CAPABILITY_VERSION_3 = 0x20080522  # <linux/capability.h>: two 32-bit words per set


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_permission_override() -> None:
    """Make this process (root) subject to file permissions, and whatever it executes: drop
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set (root's capabilities after an
    exec come from it) and from this process's effective, permitted and inheritable sets (capset)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed: cannot test permissions as root here")
    header, data = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed: cannot test permissions as root here")
    keep = ~((1 << CAP_DAC_OVERRIDE) | (1 << CAP_DAC_READ_SEARCH)) & 0xFFFFFFFF
    data[0].effective &= keep
    data[0].permitted &= keep
    data[0].inheritable &= keep
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed: cannot test permissions as root here")


def _child(job: dict[str, Any]) -> int:
    os.setsid()
    if job.get("unprivileged") and os.geteuid() == 0:
        drop_permission_override()
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # the server's own disposition (serve) is not the command's
    os.chdir(job["cwd"])
    os.environ.update(job.get("env", {}))
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # not the server's request pipe (ZygoteServer): nothing it starts reads that
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    argv, kind = list(job["argv"]), job["kind"]
    try:
        if kind == "shardwise":
            from shardwise.cli import main

            sys.argv = ["shardwise", *argv]
            return int(main(argv) or 0)
        if kind == "python":
            import runpy

            sys.argv = argv
            if job.get("executable"):  # what the script starts as `sys.executable` (a forking `python`)
                sys.executable = job["executable"]
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
            return 0
        module, function, *args = argv
        return int(getattr(importlib.import_module(module), function)(*args) or 0)
    except SystemExit as exc:  # what the interpreter does with it
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - the command's own traceback, as its entry point would print it
        traceback.print_exc()
        return 1


def _fork(job: dict[str, Any]) -> int:
    pid = os.fork()
    if pid:
        return pid
    rc = 1
    try:
        rc = _child(job)
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc if 0 <= rc < 256 else 1)
    return 0  # not reached


def run(jobs: list[dict[str, Any]], parallel: int) -> dict[str, dict[str, Any]]:
    """Run ``jobs`` (module doc) and return their results by id."""
    pending = sorted(jobs, key=lambda j: -float(j.get("cost", 1.0)))
    running: dict[int, tuple[dict[str, Any], float]] = {}
    results: dict[str, dict[str, Any]] = {}
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            running[_fork(job)] = (job, time.monotonic())
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for pid_, (job, start) in list(running.items()):
                if now - start > float(job.get("timeout_s", 300)):
                    try:
                        os.killpg(pid_, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    os.waitpid(pid_, 0)
                    del running[pid_]
                    results[job["id"]] = {"rc": "timeout", "seconds": now - start}
            time.sleep(0.02)
            continue
        if pid in running:
            job, start = running.pop(pid)
            try:
                os.killpg(pid, signal.SIGKILL)  # anything the command left behind in its session
            except (ProcessLookupError, PermissionError):
                pass
            results[job["id"]] = {"rc": os.waitstatus_to_exitcode(status), "seconds": time.monotonic() - start,
                                  "cpu_s": usage.ru_utime + usage.ru_stime}  # its processes', those it waited for
    return results


def run_phases(
    phases: list[list[dict[str, Any]]],
    *,
    parallel: int | None = None,
    env: dict[str, str | None] | None = None,
    preload: tuple[str, ...] = (),
    timeout_s: float = 1800,
) -> dict[str, dict[str, Any]]:
    """From a test: start the server (module doc) in this environment updated with ``env`` (a
    None value removes the variable), importing PRELOAD and ``preload``, run ``phases`` (lists of
    jobs, one after the other) and return the results by job id."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    request = {
        "root": root,
        "parallel": parallel or os.cpu_count() or 1,
        "phases": phases,
        "preload": [*PRELOAD, *preload],
    }
    server_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    done = subprocess.run(
        [sys.executable, "-m", "tests.forkrun"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=root,
        env=server_env,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(f"tests.forkrun exited {done.returncode}:\n{done.stderr[-3000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if "error" in answer:
        raise RuntimeError(answer["error"])
    return answer["results"]


class Zygote:
    """A server (module doc) that stays up: :meth:`run` sends it phases and returns the results by
    job id, the imports paid once when it starts. One request at a time (not thread-safe).
    ``quiet_dependencies``: silence the dependencies' import noise first, as shardwise's entry
    points do (shardwise.runtime.quiet), so that the server's stderr (``log``) holds only what a
    command would print. The server itself forks from the session's fork server when its
    environment names one (tests/worker_forkserver.py), so most of its imports are done already."""

    def __init__(
        self, *, env: dict[str, str | None] | None = None, preload: tuple[str, ...] = (), log: str | None = None,
        quiet_dependencies: bool = False,
    ) -> None:
        import subprocess
        import tempfile

        from tests.worker_forkserver import python

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        server_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
        self.log = log or tempfile.mkstemp(prefix="forkrun-", suffix=".log")[1]
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(python("-m", "tests.forkrun", "--serve", env=server_env),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=root,
                                         env=server_env)
        self._ask({"root": root, "preload": [*PRELOAD, *preload], "quiet_dependencies": quiet_dependencies})

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tests.forkrun --serve exited {self.proc.wait()}:\n{open(self.log).read()[-3000:]}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def run(self, phases: list[list[dict[str, Any]]], *, parallel: int = 1) -> dict[str, dict[str, Any]]:
        return self._ask({"phases": phases, "parallel": parallel})["results"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - it is stopped either way
                self.proc.kill()
                self.proc.wait()


class ZygoteDir(str):
    """A test module's work directory (a path), and the zygote its commands fork from."""

    zygote: Zygote

    @classmethod
    def of(cls, path: Any, zygote: Zygote) -> ZygoteDir:
        out = cls(path)
        out.zygote = zygote
        return out


def shardwise_command(zygote: Zygote, args: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                      timeout: float = 300) -> Any:
    """``shardwise *args`` forked from ``zygote``: what ``subprocess.run([sys.executable, "-m",
    "shardwise.cli", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``
    returns (a ``CompletedProcess``; ``TimeoutExpired`` when it ran out of time), without the
    command's imports (its worker processes are started as usual)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="forkrun-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        job = {
            "id": "cmd",
            "kind": "shardwise",
            "argv": list(args),
            "cwd": cwd or os.getcwd(),
            "env": dict(env or os.environ),
            "stdout": out,
            "stderr": err,
            "timeout_s": timeout,
        }
        got = zygote.run([[job]])["cmd"]
        stdout, stderr = (open(path, errors="replace").read() if os.path.exists(path) else "" for path in (out, err))
    argv = [sys.executable, "-m", "shardwise.cli", *args]
    if got["rc"] == "timeout":
        raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(argv, int(got["rc"]), stdout, stderr)


def _prepare(request: dict[str, Any]) -> str | None:
    """Import what the request names; an error line when the process is not safe to fork."""
    sys.path.insert(0, request.get("root", os.getcwd()))
    from shardwise.runtime.quiet import quiet_while

    # the import noise, silenced as shardwise's entry points do, where the request asks for it
    with quiet_while(os.environ) if request.get("quiet_dependencies") else contextlib.nullcontext():
        for name in request.get("preload", PRELOAD):
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    if threading.active_count() != 1:  # a forked child would miss the other threads' locks
        return f"{threading.active_count()} threads after the imports: {threading.enumerate()}"
    gc.freeze()  # as the fork server does: a child's collections skip the imported heap
    return None


def serve() -> None:
    """The server of :class:`Zygote`: the first line names the imports, each next one is a batch of phases."""
    # A process that passes SIGUSR1 (a time-limit warning) to its children, as a launcher does, must
    # not end this server when it happens to run beside it under the same parent (a pytest worker).
    signal.signal(
        signal.SIGUSR1, lambda *_: print("forkrun: SIGUSR1 ignored by the server", file=sys.stderr, flush=True)
    )
    error = _prepare(json.loads(sys.stdin.readline()))
    print(json.dumps({"error": error} if error else {"ready": True}), flush=True)
    if error:
        return
    for line in sys.stdin:
        request = json.loads(line)
        results: dict[str, Any] = {}
        for phase in request["phases"]:
            results.update(run(phase, int(request.get("parallel", 1))))
        print(json.dumps({"results": results}), flush=True)


def main() -> None:
    if "--serve" in sys.argv[1:]:
        serve()
        return
    request = json.load(sys.stdin)
    error = _prepare(request)
    if error:
        print(json.dumps({"error": error}))
        return
    results: dict[str, Any] = {}
    for phase in request["phases"]:  # a phase starts when the one before it has finished
        results.update(run(phase, int(request.get("parallel", os.cpu_count() or 1))))
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
