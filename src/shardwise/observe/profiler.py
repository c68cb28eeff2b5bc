"""The cheap step profiler: where each step's wall-clock time went, on this rank.

Per step it splits the time between two step boundaries into

- ``data``: waiting for the next batch (time inside :meth:`StepProfiler.loader`'s ``next()``, or,
  when the loader is not wrapped, the time from the step's start to the first forward);
- ``forward`` / ``backward`` / ``optimizer``: compute, measured by hooks on the root module (forward
  pre/post hooks; backward from the moment the output's gradient arrives to the autograd engine's
  end-of-backward callback) and on the optimizer (step pre/post hooks), *minus* the time spent
  inside collectives during that phase;
- ``comm``: time the training thread was blocked inside ``torch.distributed`` collectives, by
  operation (``all_reduce``, ``all_gather_into_tensor``, ...), plus ``grad_sync``: DDP's wait for its
  bucketed gradient all-reduces at the end of backward (the time between our end-of-compute
  callback and a second callback queued after DDP's own; only the *exposed* part, since the
  overlapped part runs on the backend's thread while backward computes);
- ``idle``: the rest (Python in the loop, logging, host syncs such as ``loss.item()``).

How communication is measured, and why this way: ``torch.distributed``'s collective functions are
wrapped while the profiler is attached (a re-entrancy guard counts nested calls such as
``all_gather_object`` -> ``all_gather`` once), which costs two ``perf_counter`` calls per collective
and sees every collective issued from Python (user code, FSDP2, DCP). DDP's reducer issues its
all-reduces from C++, so for DDP the exposed wait is measured with autograd callbacks as above. On
GPUs these are host-side times: a collective that returns before the device finishes is counted at
its launch cost; the deep profiler (:mod:`shardwise.observe.deep`) has the device view.

Cost: a handful of Python hook calls per step and two clock reads per collective (measured by
``bench/profiler_overhead.py``). Nothing is communicated; :mod:`shardwise.observe.stragglers`
gathers summaries across ranks at the logging interval.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

PHASES = ("data", "forward", "backward", "optimizer")
COMM_OPS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list", "all_reduce_coalesced",
)
_PATCHED_FLAG = "__shardwise_profiler__"


class CommSplit(ABC):
    """A span of one rank's time (``span_s``) and the seconds of it spent blocked in collectives
    (``comm_s``: operation -> seconds); one step (:class:`StepTimes`) or a window's mean
    (:class:`~shardwise.observe.stragglers.RankSummary`)."""

    comm_s: dict

    @property
    @abstractmethod
    def span_s(self) -> float:
        """The seconds this record spans (a step's, or a window's mean step)."""

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values())

    @property
    def busy_s(self) -> float:
        """The span minus the time spent waiting in collectives: what this rank itself took."""
        return self.span_s - self.comm_total_s


@dataclass(frozen=True)
class StepTimes(CommSplit):
    """One rank's breakdown of one step, in seconds (see the module doc for each part)."""

    step: int
    total_s: float
    data_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    comm_s: dict = field(default_factory=dict)  # operation -> seconds blocked
    idle_s: float = 0.0
    start: float = 0.0  # time.perf_counter() at the step's start (for timelines)
    segments: tuple = ()  # (kind, t0, t1) relative to ``start``; kind in PHASES + ("comm",)

    @property
    def span_s(self) -> float:
        return self.total_s


class _CommPatch:
    """Wraps ``torch.distributed``'s collective functions to time them (installed by one profiler)."""

    def __init__(self, record: Callable[[str, float, float], None]) -> None:
        self._record = record
        self._saved: list[tuple[Any, str, Any]] = []
        self._local = threading.local()

    def install(self) -> bool:
        modules = (dist, dist.distributed_c10d)
        if any(getattr(getattr(dist, op, None), _PATCHED_FLAG, False) for op in COMM_OPS):
            return False  # another profiler is timing them already
        for module in modules:
            for op in COMM_OPS:
                fn = getattr(module, op, None)
                if fn is not None:
                    self._saved.append((module, op, fn))
                    setattr(module, op, self._wrap(op, fn))
        return True

    def remove(self) -> None:
        for module, op, fn in reversed(self._saved):
            setattr(module, op, fn)
        self._saved = []

    def _wrap(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        local, record = self._local, self._record

        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "depth", 0):
                return fn(*args, **kwargs)
            local.depth = 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth = 0
                record(op, t0, time.perf_counter())

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(timed, _PATCHED_FLAG, True)
        return timed


class StepProfiler:
    """Per-step time breakdown on this rank (see the module doc).

    Plain loop::

        prof = StepProfiler().attach(model, optimizer)
        for step, batch in enumerate(prof.loader(loader), 1):
            loss = loss_fn(model(batch.x), batch.y)
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            prof.end_step(step)          # also starts the next step
        prof.detach()
    """

    def __init__(self, *, keep: int = 10_000, time_comm: bool = True) -> None:
        self.records: deque[StepTimes] = deque(maxlen=keep)
        self.time_comm = time_comm
        self._handles: list[Any] = []
        self._patch: _CommPatch | None = None
        self._reset(time.perf_counter())

    # -- step boundaries ---------------------------------------------------------------------
    def _reset(self, now: float) -> None:
        self._start = now
        self._acc = dict.fromkeys(PHASES, 0.0)
        self._comm: dict[str, float] = {}
        self._segments: list[tuple[str, float, float]] = []
        self._open: dict[str, float] = {}  # phase -> start time, while inside it
        self._phase_comm = 0.0  # comm time inside the currently open phase
        self._first_forward: float | None = None
        self._explicit_data = False
        self._compute_end: float | None = None

    def begin_step(self) -> None:
        """Start timing a step now (call before fetching its batch; :meth:`end_step` does it for you)."""
        self._reset(time.perf_counter())

    def end_step(self, step: int) -> StepTimes:
        """Close the current step, record it, and start the next one."""
        now = time.perf_counter()
        for name in list(self._open):
            self._exit(name, now)
        if not self._explicit_data and self._first_forward is not None:
            self._acc["data"] = self._first_forward - self._start
            self._segments.append(("data", self._start, self._first_forward))
        total = now - self._start
        accounted = sum(self._acc.values()) + sum(self._comm.values())
        record = StepTimes(
            step=step, total_s=total, data_s=self._acc["data"], forward_s=self._acc["forward"],
            backward_s=self._acc["backward"], optimizer_s=self._acc["optimizer"], comm_s=dict(self._comm),
            idle_s=max(0.0, total - accounted), start=self._start,
            segments=tuple((k, a - self._start, b - self._start) for k, a, b in self._segments),
        )
        self.records.append(record)
        self._reset(now)
        return record

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """``with prof.step(n): ...``: the block is one step."""
        self.begin_step()
        yield
        self.end_step(step)

    # -- phases --------------------------------------------------------------------------------
    def _enter(self, name: str, now: float) -> None:
        if self._open:  # phases do not nest: the outer one owns the time
            return
        self._open[name] = now
        self._phase_comm = 0.0
        if name == "forward" and self._first_forward is None:
            self._first_forward = now

    def _exit(self, name: str, now: float) -> None:
        start = self._open.pop(name, None)
        if start is None:
            return
        self._acc[name] += max(0.0, now - start - self._phase_comm)
        self._segments.append((name, start, now))
        self._phase_comm = 0.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a block as ``name`` (one of :data:`PHASES`), for loops that do not use the hooks."""
        if name not in PHASES:
            raise ValueError(f"phase {name!r} is not one of {PHASES}")
        if name == "data":
            self._explicit_data = True
        self._enter(name, time.perf_counter())
        try:
            yield
        finally:
            self._exit(name, time.perf_counter())

    def loader(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``iterable``, timing each ``next()`` as the data phase of the current step."""
        it = iter(iterable)
        while True:
            with self.phase("data"):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item

    def _record_comm(self, op: str, t0: float, t1: float) -> None:
        dt = t1 - t0
        self._comm[op] = self._comm.get(op, 0.0) + dt
        if self._open:
            self._phase_comm += dt
        self._segments.append(("comm", t0, t1))

    # -- hooks ---------------------------------------------------------------------------------
    def attach(self, module: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> "StepProfiler":
        """Install the hooks on ``module`` (the root: a DDP/FSDP wrapper or a plain module) and ``optimizer``,
        and start timing collectives. Returns ``self``; :meth:`detach` undoes it all."""
        if module is not None:
            self._handles.append(module.register_forward_pre_hook(self._forward_pre))
            self._handles.append(module.register_forward_hook(self._forward_post))
        if optimizer is not None:
            self._handles.append(
                optimizer.register_step_pre_hook(lambda *_: self._enter("optimizer", time.perf_counter()))
            )
            self._handles.append(
                optimizer.register_step_post_hook(lambda *_: self._exit("optimizer", time.perf_counter()))
            )
        if self.time_comm and self._patch is None:
            patch = _CommPatch(self._record_comm)
            self._patch = patch if patch.install() else None
        self.begin_step()
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._patch is not None:
            self._patch.remove()
            self._patch = None

    def __enter__(self) -> "StepProfiler":
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        self._enter("forward", time.perf_counter())

    def _forward_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._exit("forward", time.perf_counter())
        tensor = _first_grad_tensor(output)
        if tensor is not None and torch.is_grad_enabled():
            tensor.register_hook(self._backward_begins)

    def _backward_begins(self, grad: torch.Tensor) -> torch.Tensor:
        self._enter("backward", time.perf_counter())
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_compute_done)
        return grad

    def _backward_compute_done(self) -> None:
        now = time.perf_counter()
        self._exit("backward", now)
        self._compute_end = now
        # A world of one has no gradient reduction to wait for: the gap to the next callback would
        # only be scheduling noise (seen up to 0.3 ms in a busy test process).
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Queued after DDP's own end-of-backward callback (which waits for its all-reduces).
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_sync_done)

    def _backward_sync_done(self) -> None:
        if self._compute_end is None:
            return
        now = time.perf_counter()
        # Below 0.1 ms it is the callback's own scheduling cost (seen up to ~25 us on a busy host),
        # not a wait for DDP's all-reduce worth reporting.
        if now - self._compute_end > 1e-4:
            self._comm["grad_sync"] = self._comm.get("grad_sync", 0.0) + now - self._compute_end
            self._segments.append(("comm", self._compute_end, now))
        self._compute_end = None


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for item in output:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None
