"""Loggers: where the trainer writes its metrics (rank 0 only; metrics are already global).

A logger has ``log(metrics, step)`` and ``close()``. :class:`CSVLogger` is always available and is
added automatically when the trainer has a ``run_dir``; :class:`TensorBoardLogger` is added too
when the ``tensorboard`` package is installed.
"""

from __future__ import annotations

import csv
import os
from typing import Any, Mapping, Protocol

from shardwise.errors import ShardwiseError


class Logger(Protocol):
    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


class CSVLogger:
    """``<run_dir>/metrics.csv``: one row per logging step or evaluation, one column per metric.

    Training and evaluation rows have different keys; when a new key appears the file is rewritten
    with the wider header (runs log a few thousand rows at most, so this stays cheap).
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, filename: str = "metrics.csv") -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(os.fspath(run_dir), filename)
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []
        open(self.path, "w").close()  # a fresh file per run

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        row = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns += new
            with open(self.path, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=self.columns)
                writer.writeheader()
                writer.writerows(self.rows)
        else:
            with open(self.path, "a", newline="") as fh:
                csv.DictWriter(fh, fieldnames=self.columns).writerow(row)

    def close(self) -> None:
        pass


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardLogger:
    """Scalars to ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>``)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        if not tensorboard_available():
            raise ShardwiseError("TensorBoardLogger needs the tensorboard package", hint="pip install tensorboard, or use CSVLogger")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(os.fspath(run_dir), "tensorboard"))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if key not in ("step", "epoch") and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()
