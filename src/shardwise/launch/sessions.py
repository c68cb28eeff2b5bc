"""Run one ssh session per host, stream their output with a host prefix, stop them all together.

Each session is a plain ``ssh`` child process of the launcher (in its own session, so a Ctrl-C
in the terminal reaches the launcher only and the stop is orderly). Its stdin is a pipe the
launcher never writes to: closing it is the stop signal, which the remote ``shardwise run
--stop-with-stdin`` turns into a clean shutdown (:mod:`shardwise.launch.lifeline`). That pipe
also closes when the launcher dies in any way, so remote processes never outlive it.

Ctrl-C: while the sessions run, SIGINT only counts (:class:`Interrupts`) and the wait loop looks
at the count. A KeyboardInterrupt raised wherever the main thread happens to be could land inside
``Popen.poll`` after it took its wait lock and before it could release it; that session would
then never look finished and the stop would wait out every grace period.

Stopping: close every stdin, wait up to ``stop_grace_s`` for the sessions to end, then SIGTERM
the ssh clients and finally SIGKILL them (sshd then hangs up on the remote side, which the
lifeline also sees). A second Ctrl-C skips the wait.

When sessions end: in a fixed world the first one to fail stops all the others and its exit
code is the job's; in an elastic world (``min_alive``) the others go on while at least that many
sessions are alive; with fault-tolerant replica groups, once one session has finished the others
get a grace period and are then stopped. All sessions ending with 0 is success.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, Iterator, Sequence

POLL_S = 0.1
DEFAULT_STOP_GRACE_S = 50.0


@dataclass(frozen=True)
class Session:
    """One host's ssh command line and the prefix of its output lines."""

    label: str
    argv: tuple[str, ...]
    rejoin: str = ""  # elastic jobs: the command that brings this host back, printed when it is lost


@dataclass(frozen=True)
class Outcome:
    """How the sessions ended: the job's exit code and, on failure, the session that decided it."""

    exit_code: int
    failed: str | None = None  # the label of the first failed session
    failed_code: int | None = None
    lost: tuple[str, ...] = ()  # sessions that failed while an elastic job went on
    interrupted: bool = False


class Interrupts:
    """How many times SIGINT arrived while :meth:`counting` was active (see the module doc)."""

    def __init__(self) -> None:
        self.count = 0

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.count += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[Interrupts]:
        """Count SIGINT instead of raising KeyboardInterrupt (main thread only; elsewhere a no-op,
        as only the main thread receives KeyboardInterrupt anyway)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def _pump(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


class Sessions:
    """The running sessions (see the module doc); use as a context manager so they always stop."""

    def __init__(self, sessions: Sequence[Session], *, stop_grace_s: float = DEFAULT_STOP_GRACE_S) -> None:
        self.sessions = list(sessions)
        self.stop_grace_s = stop_grace_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self._pumps: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._interrupts = Interrupts()

    def __enter__(self) -> Sessions:
        for s in self.sessions:
            proc = subprocess.Popen(s.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
            self.procs.append(proc)
            for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, out, f"[{s.label}] ", self._lock), daemon=True)
                t.start()
                self._pumps.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace_s=0.0 if exc[0] is KeyboardInterrupt else self.stop_grace_s)

    def wait(self, *, min_alive: int | None = None, finish_grace_s: float | None = None) -> Outcome:
        """Block until the job ends (see the module doc); Ctrl-C stops every session, a second
        one skips the wait for a clean shutdown. With ``finish_grace_s`` (fault-tolerant replica
        groups), once a session has finished (exit 0) the others get that long to finish too, then
        are stopped and the job has succeeded."""
        lost: list[str] = []
        finished_at: float | None = None
        with self._interrupts.counting():
            while not self._interrupts.count:
                codes = [p.poll() for p in self.procs]
                if finish_grace_s is not None and finished_at is None and 0 in codes:
                    finished_at = time.monotonic()
                if finished_at is not None and time.monotonic() - finished_at > finish_grace_s and None in codes:
                    self._say(f"the first hosts finished {finish_grace_s:g} s ago: stopping the "
                              f"{codes.count(None)} host(s) still running")
                    self.stop(grace_s=self.stop_grace_s)
                    return Outcome(0, lost=tuple(lost))
                for s, code in zip(self.sessions, codes):
                    if code not in (None, 0) and s.label not in lost:
                        alive = sum(c is None for c in codes)
                        if min_alive is None or alive < min_alive:
                            self.stop(grace_s=self.stop_grace_s)
                            return Outcome(code, s.label, code, tuple(lost))
                        lost.append(s.label)
                        self._say(
                            f"host {s.label} left the job (exit code {code}); it goes on with {alive} host(s), "
                            f"at least {min_alive} needed"
                            + (f"; to bring it back, run there: {s.rejoin}" if s.rejoin else "")
                        )
                if all(c is not None for c in codes):
                    failed = [(s.label, c) for s, c in zip(self.sessions, codes) if c != 0]
                    if not failed or (min_alive is not None and len(failed) < len(codes)):
                        return Outcome(0, lost=tuple(lost))  # an elastic job that finished on the survivors
                    return Outcome(failed[0][1], failed[0][0], failed[0][1], tuple(lost))
                time.sleep(POLL_S)
            self._say("interrupted: stopping every host")
            self.stop(grace_s=self.stop_grace_s)  # still counting: a second Ctrl-C ends the grace period
            return Outcome(130, interrupted=True, lost=tuple(lost))

    def stop(self, *, grace_s: float) -> None:
        """Close every stdin (the remote side stops), wait up to ``grace_s``, then kill the clients."""
        for p in self.procs:
            if p.stdin and not p.stdin.closed:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline and self._interrupts.count < 2:
            time.sleep(POLL_S)
        for signal_name in ("terminate", "kill"):
            alive = [p for p in self.procs if p.poll() is None]
            for p in alive:
                getattr(p, signal_name)()
            end = time.monotonic() + 5.0
            while any(p.poll() is None for p in alive) and time.monotonic() < end:
                time.sleep(POLL_S)
        for t in self._pumps:
            t.join(timeout=2.0)

    def _say(self, line: str) -> None:
        with self._lock:
            print(f"shardwise run: {line}", file=sys.stderr, flush=True)
