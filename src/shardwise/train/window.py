"""The trainer's logging window: the global mean loss and the throughput since the last log."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise.train.metrics import throughput


@dataclass
class LogWindow:
    """Steps since the last log: their per-step mean losses (still on the device) and wall time.

    ``flush`` turns them into ``loss`` (the mean over every sample of those steps on every
    data-parallel rank), ``step_time_s`` and the throughput figures. Communication: one all-reduce
    (SUM) of one float over ``group`` (the dp x cp ranks); it also synchronizes the ranks, so the wall time measured
    here is the true step time.
    """

    group: Any
    ranks: int  # the ranks whose losses are averaged (dp x cp)
    global_batch_size: int
    tokens_per_sample: int | None = None
    flops_per_sample: float | None = None
    peak_flops_total: float | None = None
    steps: int = 0
    _loss: torch.Tensor | None = None
    _start: float = field(default_factory=time.perf_counter)

    def add(self, step_loss: torch.Tensor) -> None:
        """One optimizer step's mean loss (a 0-d tensor, not read yet: no device sync)."""
        self._loss = step_loss if self._loss is None else self._loss + step_loss
        self.steps += 1

    def restart_clock(self) -> None:
        """Time spent outside training steps (evaluation) is not training throughput."""
        self._start = time.perf_counter()

    def flush(self) -> dict[str, float]:
        loss = self._loss.detach().clone().double()  # type: ignore[union-attr]
        if self.ranks > 1:
            dist.all_reduce(loss, group=self.group)
        now = time.perf_counter()
        seconds, steps = now - self._start, self.steps
        out = {"loss": loss.item() / (self.ranks * steps), "step_time_s": seconds / steps}
        out.update(
            throughput(
                samples=steps * self.global_batch_size,
                seconds=seconds,
                tokens_per_sample=self.tokens_per_sample,
                flops_per_sample=self.flops_per_sample,
                peak_flops_total=self.peak_flops_total,
            )
        )
        self._start, self.steps, self._loss = now, 0, None
        return out
