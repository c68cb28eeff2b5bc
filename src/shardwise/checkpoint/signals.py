"""Pre-emption signals: SIGTERM (sent by Slurm, Kubernetes, the elastic agent) and SIGUSR1
(Slurm's ``--signal=USR1@<seconds>`` warning before the time limit).

The handler only records the request; the training loop checks it at a step boundary, where all
ranks agree on it (one all-reduce, since ranks receive signals at slightly different times),
save a checkpoint and stop cleanly. Saving inside the handler itself would run collectives at an
arbitrary point of the step, which deadlocks.

One process has one set of signal handlers, so there is one request per process:
:func:`process_signal` returns it (the documented exception to "no global mutable state").
Installs nest: the built-in job holds it for the whole life of a worker process and every
``fit`` holds it again, so a signal that arrives before ``fit`` (while the job builds its model)
is honoured at the first step, and one that arrives after (a scheduler's copy of the signal the
launcher already forwarded) is recorded instead of killing a worker that is writing its last
files. When the last holder lets go, the previous handlers come back and the request is dropped.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Iterable

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionSignal:
    """Install with :meth:`install` (main thread only), read :attr:`requested`, then :meth:`uninstall`."""

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self._depth = 0
        self._held: list[bool] = []  # one entry per open ``with`` block: whether its install took effect
        self.received: int | None = None

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signum
        self._event.set()

    def consume(self) -> None:
        """Mark the pending request as acted on (a checkpoint was saved and training stopped), so that a
        later ``fit`` in the same process does not stop at once. :attr:`received` keeps the signal."""
        self._event.clear()

    def install(self) -> bool:
        """Returns False (and installs nothing) off the main thread, where Python cannot catch signals.
        Nested installs share the handlers; each needs its :meth:`uninstall`."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._depth += 1
        if self._depth == 1:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        """Undo one :meth:`install`; the last one restores the previous handlers and drops the request."""
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        self._event.clear()
        self.received = None

    def __enter__(self) -> "PreemptionSignal":
        self._held.append(self.install())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._held.pop():
            self.uninstall()


_PROCESS = PreemptionSignal()


def process_signal() -> PreemptionSignal:
    """This process's pre-emption request (one per process, because signal handlers are)."""
    return _PROCESS
