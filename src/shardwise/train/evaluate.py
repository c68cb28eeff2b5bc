"""Exact distributed evaluation: every sample counted once, metrics as global sums over counts.

Each data-parallel rank evaluates its unpadded shard (:class:`~shardwise.data.sampler.EvalSampler`).
For every batch the loss contributes ``mean_loss * batch_samples`` to a sum and ``batch_samples``
to a count, and each metric its own ``(sum, count)``; one all-reduce over the dp mesh at the end
turns them into global means (:class:`~shardwise.train.metrics.SumCount`).

Shards may differ by one sample and so by one batch. When the forward itself communicates (FSDP
all-gathers, TP collectives, pipeline sends) every rank must run the same number of forwards, so
ranks with fewer batches run extra forwards on a batch they already have and discard the result
(the count of batches is agreed by one all-reduce MAX over the world).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from shardwise.errors import ConfigError
from shardwise.parallel.parallelize import ParallelModel
from shardwise.train.batch import move_batch, split_batch
from shardwise.train.metrics import MetricFn, SumCount
from shardwise.train.precision import autocast


def _forward_module(pm: ParallelModel) -> nn.Module:
    # DDP adds nothing to a no-grad forward but may sync buffers; use the replica itself.
    return pm.module.module if isinstance(pm.module, DistributedDataParallel) else pm.module


def _forwards_communicate(pm: ParallelModel) -> bool:
    plan = pm.plan
    return plan.fsdp_enabled or plan.tp_enabled or plan.pp_enabled or plan.cp_enabled


@torch.no_grad()
def evaluate(
    pm: ParallelModel,
    loader: DataLoader,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    metrics: dict[str, MetricFn],
    precision: str,
    device: torch.device,
    non_blocking: bool = False,
) -> dict[str, float]:
    """``{"loss": ..., <metric>: ...}`` over the whole dataset behind ``loader`` (see the module doc)."""
    module = _forward_module(pm)
    was_training = module.training
    module.eval()
    acc = SumCount()
    n_local = len(loader)
    n_steps = n_local
    if _forwards_communicate(pm) and dist.is_initialized():
        count = torch.tensor([n_local], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        n_steps = int(count.item())
    pipeline_eval = getattr(pm.pipeline, "eval_loss", None) if pm.pipeline is not None else None
    if pm.pipeline is not None and pipeline_eval is None:
        raise ConfigError("evaluation with a pipeline needs a runner with eval_loss(inputs, targets)", hint="evaluate without pp, or use a pipeline runner that supports evaluation")
    it = iter(loader)
    last: Any = None
    try:
        for i in range(n_steps):
            real = i < n_local
            if real:
                last = move_batch(next(it), device, non_blocking)
            elif last is None:  # this rank's shard is empty: borrow one sample for the forward
                last = move_batch(loader.collate_fn([loader.dataset[0]]), device, non_blocking)
            inputs, targets, extra = pm.shard_batch(*split_batch(last))
            with autocast(precision, device.type), pm.step_context():
                if pipeline_eval is not None:
                    loss, outputs = pipeline_eval(inputs, targets, **extra), None
                else:
                    outputs = module(inputs, **extra)
                    loss = loss_fn(outputs, targets)
            if not real:
                continue
            n = targets.shape[0]
            acc.add("loss", loss.float() * n, n)
            if outputs is not None:
                for name, fn in metrics.items():
                    total, count = fn(outputs, targets)
                    acc.add(name, total, count)
    finally:
        module.train(was_training)
    names = ["loss", *(metrics if pipeline_eval is None else ())]
    # Context-parallel ranks each hold the mean over their (equally many) tokens of the same
    # samples: reducing over dp x cp averages them into the mean over every token.
    return acc.reduce(pm.meshes.tokens.get_group(), names, device)
