"""A PNG of the training curves: loss (train and validation) and throughput against the step."""

from __future__ import annotations

import csv
import math
import os
from typing import Any, Mapping, Sequence

from shardwise.errors import ShardwiseError


def read_csv(path: str) -> list[dict[str, float]]:
    """Rows of a :class:`~shardwise.train.loggers.CSVLogger` file, numbers as floats."""
    rows = []
    with open(path, newline="") as fh:
        for raw in csv.DictReader(fh):
            rows.append({k: float(v) for k, v in raw.items() if v not in ("", None)})
    return rows


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r and isinstance(r[key], (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_curves(history: Sequence[Mapping[str, Any]] | str, path: str) -> str:
    """Write loss and throughput curves from ``history`` (trainer rows, or a metrics.csv path) to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShardwiseError("plotting needs matplotlib", hint="pip install matplotlib (or shardwise[plot])") from None
    rows = read_csv(history) if isinstance(history, str) else list(history)
    fig, (ax_loss, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("loss", "train loss"), ("val_loss", "validation loss")):
        xs, ys = _series(rows, key)
        if xs:
            ax_loss.plot(xs, ys, marker="o" if key == "val_loss" else None, label=label)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    key = "tokens_per_s" if _series(rows, "tokens_per_s")[0] else "samples_per_s"
    xs, ys = _series(rows, key)
    ax_rate.plot(xs, ys, color="tab:green")
    ax_rate.set_xlabel("step")
    ax_rate.set_ylabel(key.replace("_per_s", "/s"))
    ax_rate.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
