"""The hang watchdog: turn a silent distributed hang into a report and a non-zero exit.

How it works (one daemon thread per rank, started by :func:`shardwise.init`):

1. **What this rank is doing** comes from torch itself: the *flight recorder* (switched on by
   :func:`enable_flight_recorder` before the process group forms, for Gloo and NCCL) records every
   collective any code issues — ``dist.all_reduce`` in a user script, DDP's bucket all-reduce from
   C++, FSDP's all-gathers — with its group, sequence number, operation and shapes, and keeps the
   unfinished ones "active". Step numbers come from :meth:`Watchdog.step` (the Trainer calls it).
2. **Heartbeats through the rendezvous store.** Every ``interval_s`` each rank writes a small JSON
   :class:`~shardwise.runtime.hang_report.Heartbeat` under its own key (one ``set``, O(1) per rank)
   and checks one ``abort`` key. It reads the other ranks' heartbeats only when it suspects a hang,
   so the store load stays O(world) per interval. The store is reached over its own client socket,
   never through the process group, so it works while the group is stuck.
3. **Detection.** A rank is stalled when a collective has been in flight for ``timeout_s``, or when
   it finished and waited ``timeout_s`` at :meth:`close` for the others, or (only with
   ``step_timeout_s``) when a marked step has not advanced for that long outside any collective.
   The step check is off by default: a rank stuck outside collectives (a dead data loader, a
   deadlock) is named by its peers, who wait for it in the next collective, while a legitimately
   long stretch without steps (a big evaluation) would otherwise be mistaken for a hang. It then diagnoses who did not
   arrive (:func:`~shardwise.runtime.hang_report.diagnose`), publishes the verdict under ``abort``
   (first writer wins), prints it with its Python stack and in-flight collectives, and exits with
   :data:`HANG_EXIT_CODE`. Every other rank sees ``abort`` within one interval and does the same,
   so every rank dumps its stack and the whole job ends instead of waiting for a 30-minute timeout.
   A SIGSTOPped rank cannot speak: the others name it from its stale heartbeat, and the launcher's
   teardown (SIGTERM, then SIGKILL) ends it.
4. **Fallback when this thread cannot run** (a C call that holds the GIL, e.g. a CUDA sync in
   ``.item()``): :func:`faulthandler.dump_traceback_later` is re-armed every interval; if the thread
   misses it for ``timeout_s + 60`` seconds, the C-level faulthandler dumps every thread's stack and
   exits the process.

On NCCL, torch's own flight-recorder dump on timeout and desync debugging are switched on too
(``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DESYNC_DEBUG``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``).

The one piece of process-wide state is the watchdog started by ``init`` (like ``faulthandler``,
it belongs to the process, not to an object); :func:`current` returns it.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import pickle
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Iterator, MutableMapping, TextIO

import torch.distributed as dist

from shardwise.runtime.hang_report import Heartbeat, InFlight, Stall, diagnose, verdict

HANG_EXIT_CODE = 124  # like timeout(1): "it ran past its limit"
FLIGHT_RECORDER_ENTRIES = "2000"
_FAULTHANDLER_MARGIN_S = 60.0
_ACTIVE: list["Watchdog"] = []  # the watchdog init() started in this process (at most one)


def enable_flight_recorder(environ: MutableMapping[str, str], backend: str) -> None:
    """Switch on torch's collective flight recorder (and NCCL's desync debugging) unless the user set them.

    Must run before the process group is created: the recorder reads these variables once.
    """
    if "TORCH_FR_BUFFER_SIZE" not in environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ:
        environ["TORCH_FR_BUFFER_SIZE"] = FLIGHT_RECORDER_ENTRIES
    if "nccl" in backend:
        environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", environ.get("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES))
        environ.setdefault("TORCH_NCCL_DESYNC_DEBUG", "1")
        environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def in_flight_collectives() -> list[InFlight]:
    """The collectives this process has issued and that have not completed, oldest first (flight recorder)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        dump = pickle.loads(_dump_fr_trace(True, False, True))
    except Exception:  # noqa: BLE001 - no recorder in this build: nothing to report
        return []
    now_ns = time.time_ns()
    out = []
    for e in dump.get("entries", ()):
        if e.get("retired"):
            continue
        seq = e["p2p_seq_id"] if e.get("is_p2p") else e["collective_seq_id"]
        out.append(InFlight(
            pg=str(e["process_group"][0]),
            seq=int(seq),
            op=str(e.get("profiling_name", "?")).split(":")[-1],
            sizes=tuple(tuple(s) for s in e.get("input_sizes", ())),
            dtypes=tuple(e.get("input_dtypes", ())),
            age_s=max(0.0, (now_ns - int(e.get("time_created_ns", now_ns))) / 1e9),
        ))
    return sorted(out, key=lambda f: -f.age_s)


def issued_counts() -> dict[str, int]:
    """Collectives issued so far on each process group this rank belongs to (torch's per-group counters)."""
    counts = {}
    try:
        for pg, name in list(dist.distributed_c10d._world.pg_names.items()):
            with contextlib.suppress(Exception):
                counts[str(name)] = int(pg._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - no world yet
        pass
    return counts


def group_ranks(pg_name: str) -> tuple[int, ...]:
    """Global ranks of the group called ``pg_name`` (empty when unknown: treat as the world)."""
    for pg, name in list(dist.distributed_c10d._world.pg_names.items()):
        if str(name) == pg_name:
            with contextlib.suppress(Exception):
                return tuple(dist.get_process_group_ranks(pg))
    return ()


def side_store(store: dist.Store, namespace: str, *, op_timeout_s: float = 10.0) -> dist.Store:
    """A separate client connection to the same TCPStore (so our polling never blocks the group's client)."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        inner = dist.TCPStore(inner.host, inner.port, is_master=False, timeout=timedelta(seconds=op_timeout_s),
                              wait_for_workers=False)
    return dist.PrefixStore(f"shardwise-watchdog/{namespace}/", inner)


class Watchdog:
    """One rank's hang watchdog (see the module doc). Use :func:`start_watchdog` in a launched job."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        interval_s: float | None = None,
        grace_s: float | None = None,
        step_timeout_s: float | None = None,
        exit_fn: Callable[[int], None] = os._exit,
        stream: TextIO | None = None,
    ) -> None:
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.step_timeout_s = step_timeout_s
        self.interval_s = interval_s if interval_s is not None else max(0.2, min(5.0, timeout_s / 10))
        self.grace_s = grace_s if grace_s is not None else max(2.0, 3 * self.interval_s)
        self.stale_s = max(3 * self.interval_s, min(timeout_s / 2, 30.0))
        self._exit, self._stream = exit_fn, stream
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._step: int | None = None
        self._progress_t = time.monotonic()
        self._steps_running = False
        self._state = "running"
        self._finish_t: float | None = None
        self._all_finished = threading.Event()
        self._stop = threading.Event()
        self._store_lost: str | None = None  # why the store stopped answering (then: local checks only)
        self._marked = False  # counted in the store's "finished" counter
        self.report: str | None = None  # the verdict, once one was reached
        self._thread = threading.Thread(target=self._loop, name=f"shardwise-watchdog-rank{rank}", daemon=True)

    # -- the training loop's side ------------------------------------------------------------
    def start(self) -> "Watchdog":
        self._publish()
        self._thread.start()
        return self

    def step(self, step: int) -> None:
        """Mark progress: step ``step`` has finished (cheap: attribute writes). Reports show the step;
        with ``step_timeout_s`` a step that does not advance is a stall."""
        self._step, self._progress_t, self._steps_running = step, time.monotonic(), True

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Suspend the step-progress check while something else bounds the wait (torchft's quorum,
        train/ft.py); collectives are still watched."""
        running, self._steps_running = self._steps_running, False
        try:
            yield
        finally:
            self._progress_t, self._steps_running = time.monotonic(), running

    def close(self, *, wait_for_peers: bool = True) -> None:
        """Stop watching. With ``wait_for_peers``, first wait (up to ``timeout_s``) until every rank finished,
        so a rank that skipped a collective and finished early is named instead of leaving the others stuck."""
        if self._stop.is_set():
            return
        self._steps_running = False
        if wait_for_peers and self.world_size > 1 and self._thread.is_alive() and self._store_lost is None:
            self._state, self._finish_t = "finished", time.monotonic()
            try:
                self._publish()
                self._mark_finished()
                self._wait_for_peers(time.monotonic() + self.timeout_s + 2 * self.interval_s + self.grace_s + 15)
            except Exception as exc:  # noqa: BLE001 - the launcher (and its store) is gone: nobody to wait for
                self._lose_store(exc)
        elif self._store_lost is None:
            with contextlib.suppress(Exception):
                self._mark_finished()  # leaving early (an error): the others need not wait for this rank
        self._state = "exited"
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.interval_s + 11)
        if self._store_lost is None:
            with contextlib.suppress(Exception):
                self._publish()
        with contextlib.suppress(Exception):
            faulthandler.cancel_dump_traceback_later()

    def _mark_finished(self) -> None:
        """Count this rank as finished, once (one O(1) counter, so waiting for it is cheap to poll)."""
        if not self._marked:
            self._marked = True
            self.store.add("finished", 1)

    def _wait_for_peers(self, deadline: float) -> None:
        """Until every rank counted itself finished (polled every 0.1 s: a job's exit should not wait
        for the watchdog's next interval), the thread gave up, or the deadline passed."""
        while not self._all_finished.wait(0.1) and time.monotonic() < deadline:
            if self.store.add("finished", 0) >= self.world_size:
                return

    # -- the watchdog thread -----------------------------------------------------------------
    def _publish(self) -> None:
        beat = Heartbeat(rank=self.rank, host=self.host, pid=self.pid, time=time.time(), state=self._state,
                         step=self._step, issued=issued_counts(), in_flight=tuple(in_flight_collectives()[:3]))
        self.store.set(f"hb/{self.rank}", beat.to_json())

    def _lose_store(self, exc: BaseException) -> None:
        """The store stopped answering. It lives in the launcher (or in rank 0), which is gone and
        does not come back: stop calling it (each failed call logs a broken pipe) and stop waiting
        for heartbeats nobody can read; collectives of this rank are still watched."""
        if self._store_lost is None:
            self._store_lost = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            print(
                f"[shardwise watchdog] rank {self.rank}: the rendezvous store does not answer ({self._store_lost}); "
                "the launcher is probably gone; watching this rank's collectives only",
                file=self._stream or sys.stderr,
                flush=True,
            )
        self._all_finished.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._store_lost is not None:
                faulthandler.dump_traceback_later(self.timeout_s + _FAULTHANDLER_MARGIN_S, exit=True)
                stall = self._local_stall()
                if stall is not None and stall.kind != "finish":
                    self._abort(f"HANG: rank {self.rank} {stall.describe()}; the rendezvous store does not answer "
                                f"({self._store_lost}), so the other ranks could not be asked.", detected_here=True)
                    return
                continue
            try:
                faulthandler.dump_traceback_later(self.timeout_s + _FAULTHANDLER_MARGIN_S, exit=True)
                self._publish()
                if self.store.check(["abort"]):
                    self._abort(self.store.get("abort").decode(), detected_here=False)
                    return
                stall = self._local_stall()
                if stall is not None:
                    self._on_stall(stall)
                    return
                if self._finish_t is not None and self._peers_finished():
                    self._all_finished.set()
            except Exception as exc:  # noqa: BLE001 - the store is gone; keep watching locally
                self._lose_store(exc)
        self._all_finished.set()

    def _local_stall(self) -> Stall | None:
        flights = in_flight_collectives()
        if flights and flights[0].age_s > self.timeout_s:
            oldest = flights[0]
            return Stall(self.rank, "collective", oldest.age_s, oldest, group_ranks(oldest.pg), self._step)
        now = time.monotonic()
        # A finished rank waits a little longer than T, so that the ranks stuck in a collective,
        # which know which collective it is, usually speak first.
        if self._finish_t is not None and now - self._finish_t > self.timeout_s + 2 * self.interval_s:
            return Stall(self.rank, "finish", now - self._finish_t, step=self._step)
        if (self.step_timeout_s is not None and self._steps_running and self._finish_t is None and not flights
                and now - self._progress_t > self.step_timeout_s):
            return Stall(self.rank, "step", now - self._progress_t, step=self._step)
        return None

    def _heartbeats(self) -> dict[int, Heartbeat | None]:
        beats: dict[int, Heartbeat | None] = {}
        for r in range(self.world_size):
            key = f"hb/{r}"
            beats[r] = Heartbeat.from_json(self.store.get(key)) if self.store.check([key]) else None
        return beats

    def _peers_finished(self) -> bool:
        return all(b is not None and b.state in ("finished", "exited") for b in self._heartbeats().values())

    def _on_stall(self, stall: Stall) -> None:
        beats = self._heartbeats()
        text = verdict(stall, diagnose(stall, beats, now=time.time(), stale_s=self.stale_s, world_size=self.world_size))
        # First writer wins: every rank prints the same verdict.
        text = self.store.compare_set("abort", "", text).decode() or text
        self._abort(text, detected_here=True)

    def _abort(self, text: str, *, detected_here: bool) -> None:
        self.report = text
        out = self._stream or sys.stderr
        tag = f"[shardwise watchdog] rank {self.rank} ({self.host}, pid {self.pid})"
        why = "detected a hang" if detected_here else "stopping because another rank detected a hang"
        print(f"{tag} {why}:\n{text}", file=out, flush=True)
        flights = in_flight_collectives()
        print(f"{tag} step {self._step}; collectives in flight: "
              + ("; ".join(f.describe() + f" for {f.age_s:.0f} s" for f in flights) or "none"), file=out, flush=True)
        print(f"{tag} Python stacks of every thread:", file=out, flush=True)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=out, all_threads=True)
        with contextlib.suppress(Exception):
            faulthandler.cancel_dump_traceback_later()
        self._all_finished.set()
        # Wait (bounded) until every live rank has printed too: the first rank to exit breaks the
        # group's connections, and the others would die with a transport error instead of a report.
        with contextlib.suppress(Exception):
            acked = self.store.add("acks", 1)
            deadline = time.monotonic() + self.grace_s
            while acked < self.world_size and time.monotonic() < deadline:
                time.sleep(0.1)
                acked = self.store.add("acks", 0)
        print(f"{tag} exiting with code {HANG_EXIT_CODE}", file=out, flush=True)
        self._exit(HANG_EXIT_CODE)


def start_watchdog(
    *, rank: int, world_size: int, timeout_s: float, namespace: str = "local/0", **kwargs
) -> Watchdog | None:
    """Start this process's watchdog on the default group's store (``timeout_s <= 0``: none), under
    ``namespace`` (the launch attempt's, :attr:`Settings.attempt_namespace
    <shardwise.runtime.settings.Settings.attempt_namespace>`)."""
    if timeout_s <= 0 or not dist.is_initialized() or current() is not None:
        return current()
    store = side_store(dist.distributed_c10d._get_default_store(), namespace)
    dog = Watchdog(store, rank=rank, world_size=world_size, timeout_s=timeout_s, **kwargs).start()
    _ACTIVE.append(dog)
    atexit.register(_at_exit, dog)
    return dog


def _at_exit(dog: Watchdog) -> None:
    # The interpreter is exiting. If a hang verdict is out, the main thread most likely died of the
    # transport error a peer's exit caused: finish the report here (daemon threads die with the
    # interpreter) and exit with the hang code. Otherwise tell the others we left, without waiting.
    with contextlib.suppress(Exception):
        if dog.report is None and dog._store_lost is None and dog.store.check(["abort"]):
            dog.report = dog.store.get("abort").decode()
            dog._abort(dog.report, detected_here=False)
    if dog.report is not None:
        print(f"[shardwise watchdog] rank {dog.rank} ({dog.host}, pid {dog.pid}) exiting with code {HANG_EXIT_CODE}",
              file=dog._stream or sys.stderr, flush=True)
        os._exit(HANG_EXIT_CODE)
    with contextlib.suppress(Exception):
        dog.close(wait_for_peers=False)


def current() -> Watchdog | None:
    """The watchdog :func:`shardwise.init` started in this process, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def stop_watchdog(*, wait_for_peers: bool | None = None) -> None:
    """Close the process's watchdog (called by :func:`shardwise.shutdown`).

    By default it waits for the other ranks only on a normal exit: when called from a ``finally``
    block while an exception propagates, this rank failed and must leave at once, so the launcher
    can stop the others.
    """
    if wait_for_peers is None:
        wait_for_peers = sys.exc_info()[0] is None
    while _ACTIVE:
        _ACTIVE.pop().close(wait_for_peers=wait_for_peers)
