"""``shardwise.from_pretrained``: a Hugging Face model directory, parallelized, each rank reading its own slices.

::

    pm = shardwise.from_pretrained("llama-dir", plan="tp=2,pp=2,microbatches=2", loss_fn=lm_loss)
    pm.load                    # LoadStats: elements this rank read and holds, of the model's total

The steps (build on meta, parallelize, allocate the local shards, read them from the safetensors
files) are :func:`shardwise.checkpoint.hf_load.load_parallel`'s. The Trainer takes the same source
as a model: ``Trainer(Pretrained("llama-dir"), plan=..., ...)``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardwise.checkpoint.hf_load import Pretrained, load_parallel
from shardwise.layout import Plan
from shardwise.resolve import resolve_plan
from shardwise.parallel.mesh import build_mesh
from shardwise.parallel.parallelize import ParallelModel
from shardwise.runtime import env as runtime


def from_pretrained(
    path: str,
    *,
    plan: Plan | str = "dp",
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    precision: str | None = None,
    **options: Any,
) -> ParallelModel:
    """Load the model in ``path`` under ``plan`` on this world (``shardwise.init()`` if needed).

    ``loss_fn`` is needed with pipeline parallelism (it runs on the last stage); ``options`` are
    ``parallelize``'s (``tp=TPOptions(...)``, ``fsdp=``, ``pipeline=``, ``ddp=``).
    """
    env = runtime.init()
    resolved = resolve_plan(plan, env.world_size, precision=precision)
    meshes = build_mesh(resolved, env.device.type)
    return load_parallel(Pretrained(path), resolved, meshes, device=env.device, loss_fn=loss_fn, **options)
