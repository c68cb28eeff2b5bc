"""What :meth:`Trainer.fit` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FitResult:
    """What :meth:`Trainer.fit` returns."""

    step: int
    epoch: int
    train_loss: float | None  # the last logged (global) training loss
    val_metrics: dict[str, float]  # the last evaluation, ``val_``-prefixed
    elapsed_s: float
    history: list[dict[str, Any]] = field(repr=False, default_factory=list)
