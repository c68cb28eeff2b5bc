"""How a fit shows its progress on rank 0: a tqdm bar on a terminal, plain lines anywhere else.

A bar redraws itself with carriage returns, which a terminal overwrites and a file keeps: a log
file (Slurm's ``--output``, ``nohup``, CI) would fill with one endless line of redraws. So the bar
is drawn only when its stream is a terminal; otherwise rank 0 writes one plain line::

    train 14:02:31 step 120/400 (30%)  loss 2.3141  48,210 tokens/s  elapsed 1m02s  eta 2m25s

after the first step that logged a loss, then whenever ``every_s`` seconds (default 30) have
passed since the last line, and after the last step. ``loss`` and the throughput are those of the
last logging step (the Trainer reduces them every ``log_every`` steps); without
``tokens_per_sample`` the throughput is in samples/s. The ETA is the wall time of this fit so far
(evaluations included, as they recur) per step, times the steps left. Evaluation results get a
line of their own in both modes.

Per step, the line mode costs one clock read; nothing here synchronizes with the device.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from shardwise.callback import Callback

if TYPE_CHECKING:
    from shardwise.train.trainer import Trainer

DEFAULT_EVERY_S = 30.0


def duration(seconds: float) -> str:
    """``45s``, ``2m05s``, ``1h02m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _values(metrics: dict[str, Any], keys: tuple[str, ...]) -> str:
    return "  ".join(
        f"{k} {metrics[k]:.4g}" if isinstance(metrics[k], float) else f"{k} {metrics[k]}" for k in keys if k in metrics
    )


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ProgressBar(Callback):
    """Rank 0's progress: ``bar=None`` draws a tqdm bar when ``stream`` (default: ``sys.stderr``) is a
    terminal and writes plain lines every ``every_s`` seconds otherwise (module doc); ``bar=True`` /
    ``False`` forces one or the other. The Trainer adds one with the defaults; pass your own in
    ``callbacks`` to change them."""

    def __init__(self, *, leave: bool = True, every_s: float = DEFAULT_EVERY_S, stream: TextIO | None = None,
                 bar: bool | None = None) -> None:
        if not every_s > 0:
            from shardwise.errors import ConfigError

            raise ConfigError(
                f"ProgressBar(every_s={every_s!r}) must be a positive number of seconds", hint="for example every_s=30"
            )
        self.leave, self.every_s, self._stream, self._force = leave, every_s, stream, bar
        self.bar: Any = None
        self.lines = False  # writing plain lines (not a terminal)
        self._last: dict[str, Any] = {}  # the newest logged metrics
        self._start = self._printed = 0.0
        self._first_step, self._printed_step = 0, -1

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def on_fit_start(self, trainer: Trainer) -> None:
        if not trainer.env.is_main:
            return
        self._last, self._first_step = {}, trainer.step
        self._start = self._printed = time.monotonic()
        if self._force if self._force is not None else is_terminal(self.stream):
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=trainer.total_steps,
                initial=trainer.step,
                desc="train",
                unit="step",
                leave=self.leave,
                file=self.stream,
                dynamic_ncols=True,
            )
        else:
            self.lines = True

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if "loss" in metrics:
                post = {"loss": f"{metrics['loss']:.4f}"}
                if "samples_per_s" in metrics:
                    post["samples/s"] = f"{metrics['samples_per_s']:.1f}"
                if "tokens_per_s" in metrics:
                    post["tok/s"] = f"{metrics['tokens_per_s']:.0f}"
                self.bar.set_postfix(post, refresh=False)
            return
        if not self.lines:
            return
        first = "loss" in metrics and "loss" not in self._last
        if "loss" in metrics:
            self._last = metrics
        now = time.monotonic()
        if first or now - self._printed >= self.every_s or trainer.step == trainer.total_steps:
            self._progress(trainer, now)

    def _progress(self, trainer: Trainer, now: float) -> None:
        self._printed, self._printed_step = now, trainer.step
        self._write(self.line(step=trainer.step, total=trainer.total_steps, elapsed=now - self._start,
                              done=trainer.step - self._first_step))

    def line(self, *, step: int, total: int | None, elapsed: float, done: int) -> str:
        """The progress line (module doc) for ``step`` of ``total``, ``done`` steps in ``elapsed`` s of this fit."""
        parts = [
            f"train {time.strftime('%H:%M:%S')} step {step}" + (f"/{total} ({100 * step // total}%)" if total else "")
        ]
        m = self._last
        if "loss" in m:
            parts.append(f"loss {m['loss']:.4f}")
        if "tokens_per_s" in m:
            parts.append(f"{m['tokens_per_s']:,.0f} tokens/s")
        elif "samples_per_s" in m:
            parts.append(f"{m['samples_per_s']:,.1f} samples/s")
        parts.append(f"elapsed {duration(elapsed)}")
        if total and done > 0 and step < total:
            parts.append(f"eta {duration(elapsed / done * (total - step))}")
        return "  ".join(parts)

    def _write(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        text = f"step {trainer.step}: " + _values(metrics, tuple(k for k in metrics if k.startswith("val_")))
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        elif self.lines:
            self._write(text)

    def on_fit_end(self, trainer: Trainer) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.lines and self._printed_step != trainer.step:  # stopped before its last step: where it stopped
            self._progress(trainer, time.monotonic())
        self.lines = False
