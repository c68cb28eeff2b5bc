"""The values of :class:`~shardwise.checkpoint.manager.CheckpointManager`: :class:`CheckpointOptions` (when
to save and what to keep) and :class:`Loaded` (what a load restored). Both stay importable from
:mod:`shardwise.checkpoint.manager` and :mod:`shardwise.checkpoint`."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.checkpoint import commit as cm
from shardwise.errors import ConfigError


@dataclass(frozen=True)
class CheckpointOptions:
    """When to save and what to keep (see :class:`CheckpointManager`)."""

    keep_last_n: int | None = 3
    keep_best: tuple[str, str] | None = None  # (metric, "min" | "max")
    every_n_steps: int | None = None
    every_n_minutes: float | None = None
    on_epoch_end: bool = False
    async_save: bool = False
    verify: cm.Verify = "checksum"

    def __post_init__(self) -> None:
        if self.keep_best is not None and (len(self.keep_best) != 2 or self.keep_best[1] not in ("min", "max")):
            raise ConfigError(
                f"keep_best={self.keep_best!r} is not (metric, 'min'|'max')", hint="e.g. keep_best=('val_loss', 'min')"
            )
        for name in ("keep_last_n", "every_n_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value} must be at least 1")


@dataclass(frozen=True)
class Loaded:
    """What :meth:`CheckpointManager.load` restored."""

    step: int
    path: str
    marker: cm.Marker
    resharded: bool  # saved under another world size or data-parallel size
