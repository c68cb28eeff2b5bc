"""One optimizer step over ``k`` micro-batches (the Trainer's module doc states the math)::

    w_i = reduction.weigh(targets of every micro-batch)     # "tokens": one all-reduce of one int64
    for each micro-batch i (gradient all-reduce / reduce-scatter only after the last, i = k - 1):
        inputs, targets = this rank's share (cp: its sequence chunks)
        loss_i = loss_fn(model(inputs), targets)          # under autocast
        (loss_i * loss_scale * w_i).backward()             # a pipeline runs its own schedule
    [fp16: unscale, all-reduce(MAX) the inf flag over the world, skip the step if set]
    [clip by the global norm: one all-reduce of squared norms, over the pipeline stages too]
    optimizer.step(); optimizer.zero_grad(); scheduler.step()

**How a micro-batch's loss is weighted** (:mod:`shardwise.parallel.reduction`, ``D`` the ranks of
the tokens mesh, dp x cp, over which the gradients are averaged):

- ``loss_reduction="samples"``: ``w_i = 1 / k``. Right for a per-sample mean loss on micro-batches
  of equal size.
- ``loss_reduction="tokens"``: ``w_i = D n_i / N`` with ``n_i`` the targets of micro-batch ``i`` on
  this rank that are not ``ignore_index`` and ``N`` their sum over the step's micro-batches on
  every rank (counted before the first forward). A pipeline weighs each of its microbatches the
  same way, by the valid targets the last stage is handed. The update is then one process's on
  the mean over every valid target of the global batch.

A loss function that is a token mean plugs in as it is: it must return ``sum of the per-token
losses of the valid targets / n``, ``n`` being what :func:`~shardwise.parallel.reduction.valid_targets`
counts for the targets it is called with (``F.cross_entropy(..., ignore_index=-100)`` does).
Auxiliary losses that reach backward on their own (MoE load balancing, a mean over sequences)
keep the samples weight ``1 / k``.

The micro-batches' shares of the loss (``w_i x loss_i``) go into the log window, which averages
them over the tokens ranks only on logging steps (no synchronization on the others): the logged
loss is the global batch's mean under the reduction in force.

Beyond the loop a user would write, a step does only what its options need (measured against a
hand-written DDP loop by bench/ddp_throughput.py): the parameter list is built for clipping or
fp16 unscaling only; the auxiliary losses' scale is set when it changes, not per micro-batch (it
walks every module); a loss scale of exactly 1 multiplies nothing; the step's loss is summed on
the device without a sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from shardwise.parallel.parallelize import ParallelModel
from shardwise.parallel.reduction import LossReduction, StepWeights
from shardwise.train.batch import move_batch, split_batch, with_batch_kwargs
from shardwise.train.clip import clip_grad_norm_
from shardwise.train.precision import LossScaler, autocast
from shardwise.train.window import LogWindow


@dataclass
class OptimizerStep:
    """Everything one step uses, fixed for a ``fit``; call it with the step's micro-batches."""

    model: ParallelModel
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[Any, Any], torch.Tensor]
    precision: str | None
    device: torch.device
    non_blocking: bool
    clip_grad_norm: float | None
    pp_group: Any
    scaler: LossScaler | None
    lr_scheduler: Any
    window: LogWindow
    after_backward: Callable[[], None]
    reduction: LossReduction = LossReduction()
    # fault-tolerant replica groups (train/ft.py): all-reduce over the live groups and vote; False drops the step
    replicas: Callable[[torch.Tensor | None, StepWeights], bool] | None = None
    _aux_scale: float | None = None  # the auxiliary losses' scale last set on the model

    def __call__(self, micro_batches: list[Any]) -> dict[str, Any]:
        pm, k, device = self.model, len(micro_batches), self.device
        scale = self.scaler.scale if self.scaler is not None else 1.0
        parts = [split_batch(batch) for batch in micro_batches]
        if self.reduction.tokens:  # every micro-batch's targets on the device first, counted there: the host waits for nothing
            parts = [(inputs, move_batch(targets, device, self.non_blocking)) for inputs, targets in parts]
        weights = self.reduction.weigh([pm.local_targets(t) if self.reduction.tokens else t for _, t in parts], device=device)
        factor = scale / k
        if factor != self._aux_scale:  # for auxiliary losses that reach backward on their own (MoE)
            pm.set_loss_scale(factor)
            self._aux_scale = factor
        loss_sum: torch.Tensor | None = None
        for i, (batch, (inputs, targets)) in enumerate(zip(micro_batches, parts)):
            inputs, targets = move_batch((inputs, targets), device, self.non_blocking)
            inputs, targets, extra = pm.shard_batch(inputs, targets)  # cp: this rank's sequence chunks
            extra = move_batch(with_batch_kwargs(batch, extra, context_parallel=pm.context_parallel is not None), device,
                               self.non_blocking)
            # TP loss-parallel and CP's split attention need the forward and backward inside
            with pm.gradient_sync(i == k - 1), pm.step_context():
                if pm.pipeline is not None:  # forward and backward of all pipeline microbatches
                    with autocast(self.precision, device.type):
                        if weights.share is None:
                            loss = pm.pipeline.step(inputs, targets, loss_scale=factor, **extra)
                        else:
                            loss = pm.pipeline.step(inputs, targets, loss_scale=scale, tokens=weights.share, **extra)
                else:
                    with autocast(self.precision, device.type):
                        loss = self.loss_fn(pm.module(inputs, **extra), targets)
                    weight = weights.weights[i] * scale
                    (loss * weight if not (isinstance(weight, float) and weight == 1.0) else loss).backward()
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            share = weights.contribution(i, loss.detach().float())
            loss_sum = share if loss_sum is None else loss_sum + share
        self.after_backward()
        if self.replicas is not None and not self.replicas(loss_sum, weights):
            self.optimizer.zero_grad(set_to_none=True)
            return {"discarded": True}
        take_step = True
        metrics: dict[str, Any] = {}
        if self.scaler is not None or self.clip_grad_norm is not None:
            params = [p for p in pm.parameters() if p.grad is not None]
            if self.scaler is not None:
                take_step = self.scaler.unscale_(params)
            if self.clip_grad_norm is not None and take_step:
                metrics["grad_norm"] = clip_grad_norm_(params, self.clip_grad_norm, pp_group=self.pp_group,  # a tensor: no sync yet
                                                       skip=pm.tied_copies())
        if take_step:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update()
            metrics.update(loss_scale=self.scaler.scale, skipped=not take_step)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.window.add(loss_sum)
        return metrics
