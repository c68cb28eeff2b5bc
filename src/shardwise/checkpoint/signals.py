"""Pre-emption signals: SIGTERM (sent by Slurm, Kubernetes, the elastic agent) and SIGUSR1
(Slurm's ``--signal=USR1@<seconds>`` warning before the time limit).

The handler only records the request; the training loop checks it at a step boundary, where all
ranks agree on it (one all-reduce, since ranks receive signals at slightly different times),
save a checkpoint and stop cleanly. Saving inside the handler itself would run collectives at an
arbitrary point of the step, which deadlocks.
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
        self.received: int | None = None

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signum
        self._event.set()

    def install(self) -> bool:
        """Returns False (and installs nothing) off the main thread, where Python cannot catch signals."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> "PreemptionSignal":
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
