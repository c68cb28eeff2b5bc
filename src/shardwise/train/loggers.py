"""Loggers: where the trainer writes its metrics (rank 0 only; metrics are already global).

A logger has ``log(metrics, step)`` and ``close()``. :class:`CSVLogger` is always available and is
added automatically when the trainer has a ``run_dir``; :class:`TensorBoardLogger` is added too
when the ``tensorboard`` package is installed. Experiment trackers (MLflow, W&B) are in
:mod:`shardwise.train.trackers`.
"""

from __future__ import annotations

import csv
import os
from typing import Any, Mapping, Protocol

from shardwise.errors import ShardwiseError


class Logger(Protocol):
    """``begin(step)`` (optional) is called once when training starts, after a resume was accepted,
    with the step training continues from (0 for a fresh run); then ``log`` per row, ``close`` at the end."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


class CSVLogger:
    """``<run_dir>/metrics.csv``: one row per logging step or evaluation, one column per metric.

    Nothing is written before :meth:`begin` (or the first row): a run refused at start leaves the
    file as it was. A run resumed at step ``S`` keeps the file's rows up to ``S`` and appends; rows
    after ``S`` are steps that will be redone, so they are dropped. A fresh run starts a new file.
    Training and evaluation rows have different keys; when a new key appears the file is rewritten
    with the wider header (runs log a few thousand rows at most, so this stays cheap).
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, filename: str = "metrics.csv") -> None:
        self.run_dir = os.fspath(run_dir)
        self.path = os.path.join(self.run_dir, filename)
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []
        self._begun = False

    def begin(self, step: int = 0) -> None:
        """Start writing: keep the rows up to ``step`` of a resumed run (none for ``step`` 0)."""
        os.makedirs(self.run_dir, exist_ok=True)
        kept: list[dict[str, Any]] = []
        columns = ["step"]
        if step > 0 and os.path.exists(self.path):
            with open(self.path, newline="") as fh:
                reader = csv.DictReader(fh)
                columns = list(reader.fieldnames or ["step"])
                kept = [row for row in reader if _row_step(row) is not None and _row_step(row) <= step]  # type: ignore[operator]
        self.columns, self.rows = columns, [{k: v for k, v in row.items() if v != ""} for row in kept]
        self._rewrite()
        self._begun = True

    def _rewrite(self) -> None:
        with open(self.path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self._begun:
            self.begin(0)
        row = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns += new
            self._rewrite()
        else:
            with open(self.path, "a", newline="") as fh:
                csv.DictWriter(fh, fieldnames=self.columns).writerow(row)

    def close(self) -> None:
        pass


def _row_step(row: Mapping[str, Any]) -> int | None:
    try:
        return int(float(row.get("step", "")))
    except (TypeError, ValueError):
        return None


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardLogger:
    """Scalars to ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>``). The writer opens at
    :meth:`begin`; a run resumed at step ``S`` purges the events after ``S`` (steps to be redone)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        if not tensorboard_available():
            raise ShardwiseError(
                "TensorBoardLogger needs the tensorboard package", hint="pip install tensorboard, or use CSVLogger"
            )
        self.log_dir = os.path.join(os.fspath(run_dir), "tensorboard")
        self.writer: Any = None

    def begin(self, step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=step + 1 if step > 0 else None)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self.writer is None:
            self.begin(0)
        for key, value in metrics.items():
            if key not in ("step", "epoch") and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
