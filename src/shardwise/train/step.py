"""One optimizer step over ``k`` micro-batches (the Trainer's module doc states the math)::

    for each micro-batch i (gradient all-reduce / reduce-scatter only after the last, i = k - 1):
        inputs, targets = this rank's share (cp: its sequence chunks)
        loss_i = loss_fn(model(inputs), targets)          # under autocast
        (loss_i * loss_scale / k).backward()               # a pipeline runs its own schedule
    [fp16: unscale, all-reduce(MAX) the inf flag over the world, skip the step if set]
    [clip by the global norm: one all-reduce of squared norms, over the pipeline stages too]
    optimizer.step(); optimizer.zero_grad(); scheduler.step()

The micro-batch losses go into the log window, which averages them over the data-parallel ranks
only on logging steps (no synchronization on the others).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardwise.parallel.parallelize import ParallelModel
from shardwise.train.batch import move_batch, split_batch
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

    def __call__(self, micro_batches: list[Any]) -> dict[str, Any]:
        pm, k, device = self.model, len(micro_batches), self.device
        scale = self.scaler.scale if self.scaler is not None else 1.0
        loss_sum = torch.zeros((), device=device)
        for i, batch in enumerate(micro_batches):
            inputs, targets = split_batch(move_batch(batch, device, self.non_blocking))
            inputs, targets, extra = pm.shard_batch(inputs, targets)  # cp: this rank's sequence chunks
            pm.set_loss_scale(scale / k)  # for auxiliary losses that reach backward on their own (MoE)
            # TP loss-parallel and CP's split attention need the forward and backward inside
            with pm.gradient_sync(i == k - 1), pm.step_context():
                if pm.pipeline is not None:  # forward and backward of all pipeline microbatches
                    with autocast(self.precision, device.type):
                        loss = pm.pipeline.step(inputs, targets, loss_scale=scale / k, **extra)
                else:
                    with autocast(self.precision, device.type):
                        loss = self.loss_fn(pm.module(inputs, **extra), targets)
                    (loss * (scale / k)).backward()
            loss_sum += loss.detach().float()
        self.after_backward()
        params = [p for p in pm.parameters() if p.grad is not None]
        take_step = self.scaler.unscale_(params) if self.scaler is not None else True
        metrics: dict[str, Any] = {}
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
        self.window.add(loss_sum / k)
        return metrics
