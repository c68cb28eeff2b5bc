"""The observability pieces as Trainer callbacks (each a no-op unless passed to ``Trainer(callbacks=...)``).

- :class:`StepProfilerCallback`: the cheap per-step breakdown; every ``log_every`` steps it gathers
  the ranks' summaries (one ``all_gather_object``), logs stragglers with their host and slow phase,
  and adds this rank's breakdown to the metrics (``time_forward_ms``, ...); optionally a timeline PNG.
- :class:`NanGuardCallback`: checks gradients (and locates the first non-finite module output)
  after every backward; ``stop`` raises on every rank, ``skip`` drops that step's gradients.
- :class:`DeepProfileCallback`: ``torch.profiler`` traces for a window of steps.
- :class:`WatchdogCallback`: marks step progress for the hang watchdog that ``shardwise.init`` started.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from shardwise.runtime import watchdog
from shardwise.observe.deep import DeepProfiler
from shardwise.observe.nan import NanGuard, Policy
from shardwise.observe.profiler import StepProfiler
from shardwise.observe.stragglers import find_stragglers, format_table, gather_summaries, summarize
from shardwise.runtime.logging import get_logger
from shardwise.callback import Callback

if TYPE_CHECKING:
    from shardwise.train.trainer import Trainer

log = get_logger("observe")


class StepProfilerCallback(Callback):
    def __init__(self, *, log_every: int = 50, threshold: float = 0.2, min_excess_s: float = 1e-3,
                 timeline_png: str | os.PathLike | None = None, timeline_steps: int = 10) -> None:
        self.log_every, self.threshold, self.min_excess_s = log_every, threshold, min_excess_s
        self.timeline_png, self.timeline_steps = timeline_png, timeline_steps
        self.profiler = StepProfiler()
        self.last_stragglers: list = []
        self._window_start = 0

    def on_fit_start(self, trainer: Trainer) -> None:
        self.profiler.attach(trainer.model.module, trainer.optimizer)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        rec = self.profiler.end_step(trainer.step)
        for part in ("data", "forward", "backward", "optimizer", "idle"):
            metrics[f"time_{part}_ms"] = getattr(rec, f"{part}_s") * 1e3
        metrics["time_comm_ms"] = rec.comm_total_s * 1e3
        if trainer.step % self.log_every == 0:
            window = list(self.profiler.records)[-self.log_every:]
            summaries = gather_summaries(summarize(window, rank=trainer.env.rank))
            self.last_stragglers = find_stragglers(summaries, threshold=self.threshold, min_excess_s=self.min_excess_s)
            metrics["stragglers"] = len(self.last_stragglers)
            if trainer.env.is_main and self.last_stragglers:
                log.warning("step %d: %s\n%s", trainer.step, "; ".join(s.describe() for s in self.last_stragglers),
                            format_table(summaries))

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.profiler.begin_step()  # evaluation time is not part of the next training step

    def on_fit_end(self, trainer: Trainer) -> None:
        self.profiler.detach()
        if self.timeline_png is None:
            return
        import torch.distributed as dist

        mine = list(self.profiler.records)[-self.timeline_steps:]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        if trainer.env.is_main:
            from shardwise.observe.plots import plot_timeline

            plot_timeline(dict(enumerate(gathered)), self.timeline_png)


class NanGuardCallback(Callback):
    def __init__(self, *, policy: Policy = "stop", locate: bool = True) -> None:
        self.policy, self.locate = policy, locate
        self.guard: NanGuard | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        self.guard = NanGuard(trainer.model.module, policy=self.policy, locate=self.locate).attach()

    def on_after_backward(self, trainer: Trainer) -> None:
        if self.guard is not None:
            self.guard.check(trainer.step + 1)  # the step being taken

    def on_fit_end(self, trainer: Trainer) -> None:
        if self.guard is not None:
            self.guard.detach()


class DeepProfileCallback(Callback):
    def __init__(self, out_dir: str | os.PathLike, *, skip: int = 5, warmup: int = 1, active: int = 3) -> None:
        self.profiler_args = dict(out_dir=out_dir, skip=skip, warmup=warmup, active=active)
        self.profiler: DeepProfiler | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        self.profiler = DeepProfiler(**self.profiler_args).start()  # type: ignore[arg-type]

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_fit_end(self, trainer: Trainer) -> None:
        if self.profiler is not None:
            result = self.profiler.stop()
            if result is not None and trainer.env.is_main:
                log.info(
                    "deep profile: %s (communication overlapped: %.0f%%)",
                    result.trace_path,
                    100 * result.overlap_fraction,
                )


class WatchdogCallback(Callback):
    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        dog = watchdog.current()
        if dog is not None:
            dog.step(trainer.step)
