"""One optimizer step over ``k`` micro-batches (the Trainer's module doc states the math); the
forward and backward are the one micro-step shared with ``prepare()`` and ``shardwise verify``
(:meth:`ParallelModel.forward_backward <shardwise.parallel.parallelize.ParallelModel.forward_backward>`)::

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
fp16 unscaling only; the auxiliary losses' scale is set when it changes, not per step (it walks
every module); a loss scale of exactly 1 multiplies nothing; the step's loss is summed on
the device without a sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardwise.parallel.micro_step import MicroBatch
from shardwise.parallel.parallelize import ParallelModel
from shardwise.parallel.reduction import LossReduction, StepWeights
from shardwise.data.batch import batch_kwargs, move_batch, split_batch
from shardwise.train.clip import clip_grad_norm_
from shardwise.train.precision import LossScaler
from shardwise.train.window import LogWindow


@dataclass(kw_only=True)
class OptimizerStep:
    """Everything one step uses, fixed for a ``fit`` (built with keywords); call it with the step's
    micro-batches."""

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

    def _micro_batch(self, batch: Any) -> MicroBatch:
        """``batch`` as the micro-step takes it; under ``"tokens"`` its targets go to the device
        first (counted there: the host waits for nothing), its inputs when its forward comes."""
        inputs, targets = split_batch(batch)
        if self.reduction.tokens:
            targets = move_batch(targets, self.device, self.non_blocking)
        return MicroBatch(inputs, targets, batch_kwargs(batch))

    def _load(self, mb: MicroBatch) -> MicroBatch:
        """``mb`` on the device, just before its forward."""
        inputs, targets, kwargs = move_batch((mb.inputs, mb.targets, mb.kwargs), self.device, self.non_blocking)
        return MicroBatch(inputs, targets, kwargs)

    def __call__(self, micro_batches: list[Any]) -> dict[str, Any]:
        pm, device = self.model, self.device
        scale = self.scaler.scale if self.scaler is not None else 1.0
        batches = [self._micro_batch(batch) for batch in micro_batches]
        result = pm.forward_backward(
            batches,
            loss_fn=self.loss_fn,
            reduction=self.reduction,
            device=device,
            loss_scale=scale,
            precision=self.precision,
            load=self._load,
        )
        loss_sum = result.loss
        self.after_backward()
        if self.replicas is not None and not self.replicas(loss_sum, result.weights):
            self.optimizer.zero_grad(set_to_none=True)
            return {"discarded": True}
        take_step = True
        metrics: dict[str, Any] = {}
        if self.scaler is not None or self.clip_grad_norm is not None:
            params = [p for p in pm.parameters() if p.grad is not None]
            if self.scaler is not None:
                take_step = self.scaler.unscale_(params)
            if self.clip_grad_norm is not None and take_step:
                metrics["grad_norm"] = clip_grad_norm_(
                    params,
                    self.clip_grad_norm,
                    pp_group=self.pp_group,  # a tensor: no sync yet
                    skip=pm.tied_copies(),
                )
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
