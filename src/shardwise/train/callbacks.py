"""The built-in callbacks (monitors, early stopping, curves; the progress bar or lines are in
:mod:`shardwise.train.progress`); the protocol and its no-op base :class:`~shardwise.callback.Callback`
are in :mod:`shardwise.callback`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from shardwise.callback import Callback
from shardwise.errors import ShardwiseError
from shardwise.runtime.logging import get_logger
from shardwise.train.progress import ProgressBar

if TYPE_CHECKING:
    from shardwise.train.trainer import Trainer

log = get_logger("train")
__all__ = [
    "Callback",
    "ProgressBar",
    "LossMonitor",
    "ThroughputMonitor",
    "LearningRateMonitor",
    "EarlyStopping",
    "PlotCurves",
]


def _fmt(metrics: dict[str, Any], keys: tuple[str, ...]) -> str:
    parts = []
    for key in keys:
        if key in metrics:
            value = metrics[key]
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return "  ".join(parts)


class LossMonitor(Callback):
    """Print the loss on logging steps (MindSpore's LossMonitor); stop with an error on nan/inf."""

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if "loss" not in metrics:
            return
        loss = metrics["loss"]
        if not math.isfinite(loss) and trainer.precision != "fp16":
            raise ShardwiseError(
                f"the training loss became {loss} at step {trainer.step}",
                hint="lower the learning rate, add clip_grad_norm, or use precision='bf16'/'fp32'",
            )
        if trainer.env.is_main:
            log.info("epoch %d step %d loss %.6f", metrics["epoch"], metrics["step"], loss)


class ThroughputMonitor(Callback):
    """Print step time, samples/s, tokens/s and MFU on logging steps (MindSpore's TimeMonitor)."""

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if trainer.env.is_main and "samples_per_s" in metrics:
            log.info(
                "step %d  %s", metrics["step"], _fmt(metrics, ("step_time_s", "samples_per_s", "tokens_per_s", "mfu"))
            )


class LearningRateMonitor(Callback):
    """Add every parameter group's learning rate (``lr_group<i>``) to the logged metrics and print
    the learning rate on logging steps."""

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        groups = trainer.optimizer.param_groups
        if len(groups) > 1:
            for i, group in enumerate(groups):
                metrics[f"lr_group{i}"] = float(group["lr"])
        if trainer.env.is_main and "loss" in metrics:
            log.info("step %d lr %.6g", metrics["step"], metrics["lr"])


class EarlyStopping(Callback):
    """Stop when ``monitor`` (an evaluation metric, e.g. ``val_loss``) has not improved by more than
    ``min_delta`` for ``patience`` evaluations."""

    def __init__(
        self, monitor: str = "val_loss", *, mode: str = "min", patience: int = 3, min_delta: float = 0.0
    ) -> None:
        if mode not in ("min", "max"):
            raise ShardwiseError(f"EarlyStopping mode={mode!r} is unknown", hint="use 'min' or 'max'")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.bad_evals = 0

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.monitor not in metrics:
            raise ShardwiseError(
                f"EarlyStopping monitors {self.monitor!r}, which evaluation does not report",
                hint=f"use one of {', '.join(metrics)}",
            )
        value = metrics[self.monitor]
        sign = 1.0 if self.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.bad_evals = value, 0
            return
        self.bad_evals += 1
        if self.bad_evals >= self.patience:
            trainer.should_stop = True
            if trainer.env.is_main:
                log.info(
                    "early stopping at step %d: %s has not improved on %.6g for %d evaluations",
                    trainer.step,
                    self.monitor,
                    self.best,
                    self.bad_evals,
                )


class PlotCurves(Callback):
    """At the end of fit, write a PNG of the loss and throughput curves (rank 0, needs matplotlib)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path

    def on_fit_end(self, trainer: Trainer) -> None:
        if not trainer.env.is_main:
            return
        path = self.path or (str(trainer.run_dir / "curves.png") if trainer.run_dir else "curves.png")
        from shardwise.train.plot import plot_curves

        plot_curves(trainer.history, path)
        log.info("wrote %s", path)
