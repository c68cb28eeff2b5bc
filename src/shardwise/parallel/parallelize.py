"""Compose the parallel techniques of a :class:`~shardwise.plan.Plan` on one device mesh.

The order is fixed, and each step depends on the previous one:

1. **pipeline split** first: it decides which layers this rank owns; everything after works on the
   local stage only;
2. **tensor parallel** next: it replaces weights by DTensors sharded over the ``tp`` mesh, which
   activation checkpointing, compile and FSDP must see;
3. **activation checkpointing** wraps the (TP-sharded) blocks, so recomputation replays the TP
   collectives too;
4. **compile** (optional) traces the checkpointed, TP-sharded blocks;
5. **FSDP or DDP** last: data-parallel wrapping must see the final parameters (FSDP shards the TP
   DTensors again over ``dp_shard``, making 2-D DTensors; DDP registers hooks on the final params).

Each technique lives in its own module as ``apply_x(model, mesh, *, options) -> model``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.ddp import DDPOptions, apply_ddp
from shardwise.parallel.mesh import Meshes
from shardwise.plan.plan import Plan


class PipelineRunner(Protocol):
    """Runs one optimizer step's forward and backward over all microbatches of a pipeline."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward + backward of the batch; returns the batch's mean (unscaled) loss on every rank."""
        ...


@dataclass
class ParallelModel:
    """What :func:`parallelize` returns.

    ``module`` is what this rank runs and what the optimizer's parameters come from: the wrapped
    model, or with pipeline parallelism the local stage module(s). ``pipeline`` is set when
    ``plan.pp > 1``; then a training step goes through ``pipeline.step`` instead of ``module(x)``.
    """

    module: nn.Module
    plan: Plan
    meshes: Meshes
    pipeline: PipelineRunner | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Turn the data-parallel gradient reduction off for non-boundary accumulation micro-steps.

        DDP: ``no_sync()`` (gradients accumulate locally, the all-reduce happens on the boundary
        step). FSDP2: ``set_requires_gradient_sync(False)`` (no reduce-scatter until the boundary).
        """
        if enabled:
            yield
            return
        module = self.module
        if hasattr(module, "no_sync"):
            with module.no_sync():
                yield
            return
        fsdp_modules = [m for m in module.modules() if hasattr(m, "set_requires_gradient_sync")]
        for m in fsdp_modules:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in fsdp_modules:
                m.set_requires_gradient_sync(True, recurse=False)


def parallelize(model: nn.Module, plan: Plan, meshes: Meshes, *, ddp: DDPOptions | None = None) -> ParallelModel:
    """Apply ``plan`` to ``model`` (in place) in the fixed order described in the module doc."""
    unsupported = [name for name, on in (("tp", plan.tp_enabled), ("pp", plan.pp_enabled), ("zero", plan.fsdp_enabled)) if on]
    if unsupported:
        raise ConfigError(f"plan {plan} needs {', '.join(unsupported)}, which this build cannot apply yet", hint="use a dp-only plan")
    if plan.dp_enabled:
        model = apply_ddp(model, meshes.dp, options=ddp or DDPOptions())
    return ParallelModel(module=model, plan=plan, meshes=meshes)
