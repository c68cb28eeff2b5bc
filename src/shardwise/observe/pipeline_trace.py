"""Record which microbatch each pipeline stage ran when, for :func:`~shardwise.observe.plots.plot_pipeline_schedule`.

:class:`PipelineRecorder` hooks the stage modules this rank runs (``runner.stages[i].submod`` of a
:class:`~shardwise.parallel.pipeline.PipelineSchedule`, or any ``{stage_index: module}``):

- forward: a pre/post hook pair per call; the k-th forward of a stage in a step is microbatch k
  (every torch schedule runs a stage's forwards in microbatch order);
- backward: from the moment the gradient of the stage's output arrives to the end of that autograd
  call (an end-of-backward callback); the k-th backward is microbatch k, in the same order.

Clocks: events are stamped with the wall clock (``time.time()``), which all processes of one host
share exactly and which NTP keeps within about a millisecond across hosts (a barrier-based origin
was tried: its exit skew under load was larger than a microbatch). :meth:`gather` brings every
rank's events to every rank (one ``all_gather_object``) and shifts them so the first starts at 0.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from shardwise.observe.plots import PipelineEvent


class PipelineRecorder:
    def __init__(self, stages: Mapping[int, nn.Module], *, group: dist.ProcessGroup | None = None) -> None:
        self.stages, self.group = dict(stages), group
        self.events: list[PipelineEvent] = []
        self._handles: list[Any] = []
        self._counts: dict[tuple[int, str], int] = {}
        self._open: dict[int, float] = {}

    def attach(self) -> "PipelineRecorder":
        for index, module in self.stages.items():
            self._handles.append(module.register_forward_pre_hook(self._pre(index)))
            self._handles.append(module.register_forward_hook(self._post(index)))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def align(self) -> None:
        """Start a new step: clear the events and the microbatch counters (call it on every rank)."""
        self.events, self._counts, self._open = [], {}, {}

    def gather(self) -> list[PipelineEvent]:
        """Every rank's events of the current step (collective on ``group``)."""
        events = list(self.events)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            out: list[list[PipelineEvent] | None] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(out, self.events, group=self.group)
            events = [e for part in out for e in (part or ())]
        t0 = min((e.start for e in events), default=0.0)
        shifted = [PipelineEvent(e.stage, e.microbatch, e.kind, e.start - t0, e.end - t0) for e in events]
        return sorted(shifted, key=lambda e: (e.stage, e.start))

    def _next(self, index: int, kind: str) -> int:
        k = self._counts.get((index, kind), 0)
        self._counts[(index, kind)] = k + 1
        return k

    def _pre(self, index: int):
        def hook(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():
                self._open[index] = time.time()
        return hook

    def _post(self, index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            start = self._open.pop(index, None)
            if start is None:
                return
            now = time.time()
            mb = self._next(index, "F")
            self.events.append(PipelineEvent(index, mb, "F", start, now))
            out = (
                output
                if isinstance(output, torch.Tensor)
                else next((o for o in output if isinstance(o, torch.Tensor)), None)
                if isinstance(output, (tuple, list))
                else None
            )
            if out is not None and out.requires_grad:
                out.register_hook(self._backward_begins(index, mb))
        return hook

    def _backward_begins(self, index: int, mb: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            start = time.time()

            def done() -> None:
                self.events.append(PipelineEvent(index, mb, "B", start, time.time()))

            torch.autograd.Variable._execution_engine.queue_callback(done)
            return grad
        return hook
