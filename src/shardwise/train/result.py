"""What :meth:`Trainer.fit` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Stop:
    """Why ``fit`` ended before its step or epoch limit.

    ``"preempted"``: a pre-emption signal (SIGTERM, SIGUSR1) reached a rank; the ranks saved
    ``checkpoint`` after ``step`` and returned, so the run continues with ``resume="auto"``.
    ``"stopped"``: a callback set ``trainer.should_stop`` (early stopping, a user's own rule).
    """

    reason: Literal["preempted", "stopped"]
    step: int
    signal: str | None = None  # "SIGTERM", "SIGUSR1" for a pre-emption
    checkpoint: str | None = None  # the step directory saved at a pre-emption


@dataclass(frozen=True)
class FitResult:
    """What :meth:`Trainer.fit` returns."""

    step: int
    epoch: int
    train_loss: float | None  # the last logged (global) training loss
    val_metrics: dict[str, float]  # the last evaluation, ``val_``-prefixed
    elapsed_s: float
    history: list[dict[str, Any]] = field(repr=False, default_factory=list)
    stop: Stop | None = None  # None: the run reached max_steps / max_epochs


def stop_of(*, should_stop: bool, limit_reached: bool, step: int, preemption: Any = None) -> Stop | None:
    """The :class:`Stop` of a ``fit`` that ended with these flags (``preemption``: the checkpoint
    callback's record, with ``signal`` and ``checkpoint``), or None when it ran to its limit (a
    signal during the last step changes nothing: the run is complete)."""
    if limit_reached:
        return None
    if preemption is not None:
        return Stop("preempted", step, signal=preemption.signal, checkpoint=preemption.checkpoint)
    return Stop("stopped", step) if should_stop else None
