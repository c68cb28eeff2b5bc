"""Models bigger than one process: build on ``meta``, parallelize, materialize only local shards.

``torch.device("meta")`` makes every parameter a shape without storage, so constructing a model
costs no memory. :func:`parallelize` then shards those shapes (TP and FSDP work on meta tensors),
and :func:`materialize` allocates only this rank's shards (``to_empty``) and fills them with the
values a single process would have drawn with the same seed:

- a model with an ``init_weights(seed)`` method (shardwise's GPT) initializes itself; it is
  responsible for writing each DTensor shard from the same full values on every rank;
- otherwise the construction-time initialization is *replayed*: ``torch.manual_seed(seed)``, then
  for each module in registration order that owns parameters, its ``reset_parameters()`` runs on a
  full-size CPU stand-in, and each rank keeps its own slice (``distribute_tensor(...,
  src_data_rank=None)``: a local slice, no communication). This equals
  ``torch.manual_seed(seed); model = build()`` when every module's parameters come from its own
  ``reset_parameters`` in registration order (true for models built from torch layers). Peak
  extra memory: one module's full parameters at a time.

A module that owns parameters but has no ``reset_parameters`` cannot be replayed; that is a
ConfigError asking for ``init_weights(seed)`` or an explicit ``init`` callable.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from shardwise.layout import Plan
from shardwise.parallel.mesh import Meshes
from shardwise.parallel.parallelize import ParallelModel, parallelize
from shardwise.parallel.replay import replay_reset_parameters


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """``factory()`` with every parameter and buffer on the meta device (no memory)."""
    with torch.device("meta"):
        return factory()


def materialize(model: nn.Module, *, device: torch.device | str, seed: int,
                init: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Allocate this rank's shards on ``device`` and initialize them deterministically (module doc)."""
    model.to_empty(device=device)
    if init is not None:
        init(model)
    elif callable(getattr(model, "init_weights", None)):
        model.init_weights(seed)
    else:
        replay_reset_parameters(model, seed=seed)
    return model


def _wraps_with_ddp(plan: Plan) -> bool:
    return plan.dp_enabled and plan.zero < 2 and not plan.tp_enabled


def parallelize_on_meta(factory: Callable[[], nn.Module], plan: Plan, meshes: Meshes, *, device: torch.device | str,
                        seed: int, init: Callable[[nn.Module], None] | None = None, **options: Any) -> ParallelModel:
    """Build ``factory()`` on meta, parallelize it, materialize the local shards (module doc).

    DDP (and ZeRO-1, which keeps DDP) replicates the whole model and broadcasts it when wrapping,
    so there the model is materialized first and wrapped after; it holds a full copy anyway.
    """
    model = build_on_meta(factory)
    if _wraps_with_ddp(plan):
        return parallelize(materialize(model, device=device, seed=seed, init=init), plan, meshes, **options)
    pm = parallelize(model, plan, meshes, **options)
    materialize(pm.module, device=device, seed=seed, init=init)
    return pm
