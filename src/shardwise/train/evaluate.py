"""Exact distributed evaluation: every sample counted once, metrics as global sums over counts.

Each data-parallel rank evaluates its unpadded shard (:class:`~shardwise.data.sampler.EvalSampler`).
For every batch the loss contributes ``mean_loss * batch_samples`` to a sum and ``batch_samples``
to a count (under ``loss_reduction="tokens"``: ``mean_loss * valid_targets`` and the valid targets
of this rank's part of the batch, so the result is the mean over every valid target), and each
metric its own ``(sum, count)``; one all-reduce over the dp mesh at the end turns them into global
means (:class:`~shardwise.train.metrics.SumCount`).

Shards may differ by one sample and so by one batch; the loop that keeps the ranks' forwards in
lockstep (extra forwards whose results are dropped) is :mod:`shardwise.train.lockstep`, shared with
prediction.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from shardwise.errors import ConfigError
from shardwise.parallel.parallelize import ParallelModel
from shardwise.parallel.reduction import LossReduction, valid_targets
from shardwise.data.batch import split_batch, with_batch_kwargs
from shardwise.train.lockstep import forward_module, run_batches
from shardwise.train.metrics import MetricFn, SumCount


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
    reduction: LossReduction = LossReduction(),
) -> dict[str, float]:
    """``{"loss": ..., <metric>: ...}`` over the whole dataset behind ``loader`` (see the module doc)."""
    module = forward_module(pm)
    pipeline_eval = getattr(pm.pipeline, "eval_loss", None) if pm.pipeline is not None else None
    if pm.pipeline is not None and pipeline_eval is None:
        raise ConfigError(
            "evaluation with a pipeline needs a runner with eval_loss(inputs, targets)",
            hint="evaluate without pp, or use a pipeline runner that supports evaluation",
        )
    acc = SumCount()

    def forward(part: tuple[Any, Any, dict[str, Any]]) -> tuple[torch.Tensor, Any, Any]:
        inputs, targets, extra = part
        if pipeline_eval is not None:
            return pipeline_eval(inputs, targets, **extra), None, targets
        outputs = module(inputs, **extra)
        return loss_fn(outputs, targets), outputs, targets

    def collect(result: tuple[torch.Tensor, Any, Any]) -> None:
        loss, outputs, targets = result
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        if reduction.tokens:  # a batch (or cp chunk) without valid targets adds nothing: its loss is 0/0
            n = valid_targets(targets, reduction.ignore_index).to(loss.device)
            acc.add("loss", torch.where(n > 0, loss.float() * n, torch.zeros_like(loss, dtype=torch.float32)), n)
        else:
            n = targets.shape[0]
            acc.add("loss", loss.float() * n, n)
        if outputs is not None:
            for name, fn in metrics.items():
                total, count = fn(outputs, targets)
                acc.add(name, total, count)

    def shard(batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        inputs, targets, extra = pm.shard_batch(*split_batch(batch))
        return inputs, targets, with_batch_kwargs(batch, extra, context_parallel=pm.context_parallel is not None)

    run_batches(pm, loader, shard=shard, forward=forward, collect=collect,
                precision=precision, device=device, non_blocking=non_blocking)
    names = ["loss", *(metrics if pipeline_eval is None else ())]
    # Context-parallel ranks each hold the mean over their (equally many) tokens of the same
    # samples: reducing over dp x cp averages them into the mean over every token.
    return acc.reduce(pm.meshes.tokens.get_group(), names, device)
