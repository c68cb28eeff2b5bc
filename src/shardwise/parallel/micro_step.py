"""Forward and backward of one optimizer step's micro-batches: the one micro-step that the Trainer
(:mod:`shardwise.train.step`), ``prepare()``'s users (``Prepared.forward_backward``), the parity
engine behind ``shardwise verify`` (:mod:`shardwise.verify.parity`) and the certification of
``plan="auto"`` all run, so what parity proves is what training computes::

    w = reduction.weigh(targets of every micro-batch)      # "tokens": one all-reduce of one int64
    for each micro-batch i (the gradient reduction only after the last, i = k - 1):
        inputs, targets, cp_kwargs = pm.shard_batch(...)    # context parallel: this rank's chunks
        loss_i = loss_fn(model(inputs, **kwargs), targets)  # under autocast
        (loss_i * w_i * S).backward()                        # a pipeline runs its own schedule
    return sum_i w_i x loss_i (and w)                        # the step's loss share on this rank

``S`` is the loss scale (fp16's dynamic scale; 1 otherwise). How ``w_i`` makes the reduced
gradient one process's is :mod:`shardwise.parallel.reduction`. The optimizer, clipping and the
loss scaler's unscaling stay with the caller.

**Communication**: under ``"tokens"`` one all-reduce of one integer over the tokens group before
the first forward; the data-parallel reduction (DDP's all-reduce, FSDP's reduce-scatter) on the
last micro-batch only (``pm.gradient_sync``), or on every one with ``sharded_accumulation``; a
pipeline's point-to-point sends inside ``pipeline.step``. Nothing waits on the host: the returned
loss is a device tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from shardwise.errors import ConfigError
from shardwise.parallel.precision import autocast
from shardwise.parallel.reduction import LossReduction, StepWeights

if TYPE_CHECKING:
    from shardwise.parallel.parallelize import ParallelModel


@dataclass(frozen=True)
class StepLoss:
    """What :func:`forward_backward` returns: ``loss``, the step's loss share on this rank (a 0-d
    float32 device tensor: ``sum_i w_i x loss_i``, the global batch's mean once averaged over the
    tokens ranks), and the ``weights`` it used (their valid-target counts, for a caller that
    combines steps further, e.g. over fault-tolerant replica groups)."""

    loss: torch.Tensor
    weights: StepWeights


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the model takes it: ``model(inputs, **kwargs)`` against ``targets``."""

    inputs: Any
    targets: Any
    kwargs: dict[str, Any] = field(default_factory=dict)


def forward_backward(
    pm: ParallelModel,
    micro_batches: Sequence[MicroBatch],
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    reduction: LossReduction,
    device: torch.device | str,
    loss_scale: float = 1.0,
    precision: str | None = None,
    load: Callable[[MicroBatch], MicroBatch] | None = None,
) -> StepLoss:
    """Forward and backward of ``micro_batches`` (module doc); the step's loss share and weights.

    ``loss_fn``: the loss as the plan runs it (``pm.loss_for(user_loss)``); a pipeline uses its own.
    ``reduction``: how micro-batches are weighed; its ``"tokens"`` counts come from the targets as
    given, so they must already be where ``device`` says. ``loss_scale``: fp16's dynamic scale.
    ``precision``: the autocast precision of the forward (None or "fp32": none). ``load``: applied
    to each micro-batch just before its forward (the Trainer moves its inputs to the device there,
    one micro-batch at a time).
    """
    k = len(micro_batches)
    weights = reduction.weigh(
        [pm.local_targets(mb.targets) if reduction.tokens else mb.targets for mb in micro_batches], device=device
    )
    pm.set_loss_scale(loss_scale / k)  # for auxiliary losses that reach backward on their own (MoE)
    device_type = torch.device(device).type
    loss_sum: torch.Tensor | None = None
    for i, mb in enumerate(micro_batches):
        mb = load(mb) if load is not None else mb
        inputs, targets, extra = pm.shard_batch(mb.inputs, mb.targets)  # cp: this rank's sequence chunks
        if pm.context_parallel is not None and "position_ids" in mb.kwargs:
            raise ConfigError(
                "a batch of packed documents (with position_ids) under context parallelism, whose split attention "
                "cannot keep the documents apart",
                hint="use padded batches with cp, or a plan without cp",
            )
        kwargs = {**mb.kwargs, **extra} if extra else mb.kwargs
        # TP loss-parallel and CP's split attention need the forward and backward inside
        with pm.gradient_sync(i == k - 1), pm.step_context():
            if pm.pipeline is not None:  # forward and backward of all pipeline microbatches
                with autocast(precision, device_type):
                    if weights.share is None:
                        loss = pm.pipeline.step(inputs, targets, loss_scale=loss_scale / k, **kwargs)
                    else:
                        loss = pm.pipeline.step(inputs, targets, loss_scale=loss_scale, tokens=weights.share, **kwargs)
            else:
                with autocast(precision, device_type):
                    loss = loss_fn(pm.module(inputs, **kwargs), targets)
                _backward(loss, weights.weights[i], loss_scale)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        share = weights.contribution(i, loss.detach().float())
        loss_sum = share if loss_sum is None else loss_sum + share
    assert loss_sum is not None, "forward_backward needs at least one micro-batch"
    return StepLoss(loss_sum, weights)


def _backward(loss: torch.Tensor, weight: float | torch.Tensor, loss_scale: float) -> None:
    """``(loss x weight x loss_scale).backward()``; a factor of exactly 1 multiplies nothing."""
    factor = weight * loss_scale if loss_scale != 1.0 else weight
    (loss * factor if not (isinstance(factor, float) and factor == 1.0) else loss).backward()
