"""The training loop: :class:`Trainer`.

One optimizer step over ``G = global_batch_size`` samples::

    micro_batch = G / (dp_size * k)                 # k = grad_accum_steps
    for each of the k micro-batches on every dp rank:
        with no gradient all-reduce unless it is the last micro-batch:
            loss = loss_fn(model(x), y)             # mean over the micro-batch, under autocast
            (loss * loss_scale / k).backward()      # DDP averages over dp ranks at the boundary
    gradient = (1 / (dp_size * k)) * sum of micro-batch means = mean over all G samples
    [fp16: unscale, all-reduce(MAX) the inf flag over the world, skip the step if set]
    [clip by the global norm]  ->  optimizer.step()  ->  scheduler.step()

so k micro-steps of batch b on n ranks equal one step of batch k*b*n on one process: every
micro-batch has the same size because each epoch is cut to whole global batches.

Everything optional is a callback or a no-op context; see :mod:`shardwise.train.callbacks`.
"""

from __future__ import annotations

import os
import pathlib
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import shardwise.runtime as runtime
from shardwise.runtime.logging import get_logger
from shardwise.data.loader import LoaderOptions, eval_loader, train_loader
from shardwise.errors import ConfigError
from shardwise.parallel.ddp import DDPOptions
from shardwise.parallel.fsdp import FSDPOptions
from shardwise.parallel.mesh import build_mesh
from shardwise.parallel.parallelize import ParallelModel, parallelize
from shardwise.parallel.pipeline import PipelineOptions
from shardwise.parallel.tp import TPOptions
from shardwise.plan.plan import Plan
from shardwise.train import evaluate as _evaluate
from shardwise.train.batch import move_batch, split_batch
from shardwise.train.callbacks import Callback, ProgressBar
from shardwise.train.clip import clip_grad_norm_
from shardwise.train.loggers import CSVLogger, Logger, TensorBoardLogger, tensorboard_available
from shardwise.train.metrics import MetricsArg, peak_flops, resolve_metrics, throughput
from shardwise.train.precision import LossScaler, autocast, check_precision
from shardwise.train.result import FitResult
from shardwise.train.setup import choose_plan, resolve_plan, seed_everything
from shardwise.train.state import ModelState, OptimizerState, TrainState

log = get_logger("train")

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class Trainer:
    """Train ``model`` with the layout ``plan`` (see the module doc for the math of one step).

    Construction initializes the process group if there is none (:func:`shardwise.init`), builds
    the meshes, moves the model to this rank's device, applies the plan and builds the optimizer,
    so ``trainer.model`` (a ParallelModel), ``trainer.optimizer``, ``trainer.meshes``,
    ``trainer.plan`` and ``trainer.env`` exist before :meth:`fit`.

    Options (all keyword-only):

    - ``loss_fn(outputs, targets)``: the mean loss of a micro-batch. Batches are ``(inputs, targets)``.
    - ``global_batch_size``: samples per optimizer step over all data-parallel ranks and micro-steps;
      each rank's micro-batch is ``global_batch_size / (dp_size * grad_accum_steps)``.
    - Every other option (optimizer and scheduler factories, plan, precision, accumulation,
      clipping, step/epoch limits, evaluation, data loading, DDP/TP/FSDP/pipeline options,
      callbacks, loggers, MFU inputs) is documented with its default in docs/training.md.
    - ``checkpoint``: a directory, CheckpointManager or CheckpointCallback (``shardwise.checkpoint``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        global_batch_size: int,
        optimizer: OptimizerFactory = _default_optimizer,
        plan: Plan | str = "dp",
        precision: str | None = None,
        grad_accum_steps: int = 1,
        clip_grad_norm: float | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[Logger] = (),
        seed: int = 0,
        max_steps: int | None = None,
        max_epochs: int | None = None,
        eval_every: int | None = None,
        eval_batch_size: int | None = None,
        log_every: int = 10,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        worker_start_method: str | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        sync_batchnorm: bool = False,
        ddp: DDPOptions = DDPOptions(),
        tp: TPOptions | None = None,
        fsdp: FSDPOptions | None = None,
        pipeline: PipelineOptions | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        metrics: MetricsArg = None,
        flops_per_sample: float | None = None,
        tokens_per_sample: int | None = None,
        peak_flops_per_device: float | None = None,
        loss_scaler: LossScaler | None = None,
        progress_bar: bool = True,
        checkpoint: Any = None,
    ) -> None:
        for name, value in (("global_batch_size", global_batch_size), ("grad_accum_steps", grad_accum_steps), ("log_every", log_every)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer", hint=f"for example {name}=1")
        self.env = runtime.init()
        # plan="auto": the planner's choice (rank 0 keeps its predictions, saved as <run_dir>/auto_plan.json)
        plan, self.auto_choice = choose_plan(plan, model, self.env, global_batch_size=global_batch_size, precision=precision,
                                             grad_accum_steps=grad_accum_steps)
        self.plan = resolve_plan(plan, self.env.world_size, precision=precision)
        precision = self.plan.precision
        dp = self.plan.dp_size
        if global_batch_size % (dp * grad_accum_steps):
            raise ConfigError(
                f"global_batch_size={global_batch_size} does not split into {dp} data-parallel ranks x {grad_accum_steps} accumulation steps",
                hint=f"use a multiple of {dp * grad_accum_steps}, e.g. {dp * grad_accum_steps * max(1, global_batch_size // (dp * grad_accum_steps))}",
            )
        self.precision = precision
        check_precision(precision, self.env.device.type)
        self.loss_fn, self.global_batch_size, self.grad_accum_steps = loss_fn, global_batch_size, grad_accum_steps
        self.micro_batch_size = global_batch_size // (dp * grad_accum_steps)
        self.clip_grad_norm, self.seed, self.max_steps, self.max_epochs = clip_grad_norm, seed, max_steps, max_epochs
        self.eval_every, self.log_every, self.shuffle = eval_every, log_every, shuffle
        self.eval_batch_size = eval_batch_size or self.micro_batch_size
        self.loader_options = LoaderOptions(
            num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers, collate_fn=collate_fn, worker_start_method=worker_start_method
        )
        self.metric_fns = resolve_metrics(metrics)
        self.flops_per_sample, self.tokens_per_sample = flops_per_sample, tokens_per_sample
        peak = peak_flops_per_device or peak_flops(self.env.device, precision)
        self.peak_flops_total = peak * self.env.world_size if peak else None
        self.run_dir = pathlib.Path(run_dir) if run_dir is not None else None

        # Wrap: meshes, then the model on its device, then the parallel layout, then the optimizer
        # (it must see the final, possibly sharded, parameters).
        self.meshes = build_mesh(self.plan, self.env.device.type)
        self.dp_rank, self.dp_size = self.meshes.dp.get_local_rank(), self.meshes.dp.size()
        # Same seed within one replica (TP/PP ranks), different across replicas (dropout).
        seed_everything(seed + self.dp_rank)
        ddp = replace(ddp, sync_batchnorm=ddp.sync_batchnorm or sync_batchnorm)
        self.model: ParallelModel = parallelize(
            model.to(self.env.device), self.plan, self.meshes, ddp=ddp, tp=tp, fsdp=fsdp, loss_fn=loss_fn, pipeline=pipeline
        )
        self.optimizer = self.model.build_optimizer(optimizer)  # ZeRO-1 wraps it to shard its state
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self.scaler = (loss_scaler or LossScaler()) if precision == "fp16" else None
        self.state = TrainState(rank=self.env.rank)
        self.should_stop = False
        self.history: list[dict[str, Any]] = []
        self.total_steps: int | None = max_steps

        self.callbacks: list[Callback] = list(callbacks)
        if progress_bar and self.env.is_main and not any(isinstance(c, ProgressBar) for c in self.callbacks):
            self.callbacks.insert(0, ProgressBar())
        # checkpoint: a directory, a CheckpointManager or a CheckpointCallback (shardwise.checkpoint)
        from shardwise.checkpoint.callback import checkpoint_callback

        self.checkpoint = checkpoint_callback(checkpoint)
        if self.checkpoint is not None:
            self.callbacks.append(self.checkpoint)
        self.loggers: list[Logger] = list(loggers)
        if self.run_dir is not None and self.env.is_main:
            if self.auto_choice is not None:
                os.makedirs(self.run_dir, exist_ok=True)
                self.auto_choice.save(os.path.join(self.run_dir, "auto_plan.json"))
            if not any(isinstance(lg, CSVLogger) for lg in self.loggers):
                self.loggers.append(CSVLogger(self.run_dir))
            if tensorboard_available() and not any(isinstance(lg, TensorBoardLogger) for lg in self.loggers):
                self.loggers.append(TensorBoardLogger(self.run_dir))

    # -- public state ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.state.step

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def stateful_components(self) -> dict[str, Any]:
        """Everything a checkpoint saves, each with ``state_dict`` / ``load_state_dict``."""
        parts: dict[str, Any] = {
            "model": ModelState(self.model.module),
            "optimizer": OptimizerState(self.model.module, self.optimizer),
            "train_state": self.state,
        }
        if self.lr_scheduler is not None:
            parts["lr_scheduler"] = self.lr_scheduler
        if self.scaler is not None:
            parts["grad_scaler"] = self.scaler
        return parts

    # -- fit ------------------------------------------------------------------------------
    def fit(self, train_data: Dataset, val_data: Dataset | None = None, *, resume: str | int | None = None) -> FitResult:
        """Train until ``max_steps`` / ``max_epochs`` (default: one epoch) or a callback stops it.

        ``resume="auto"`` restores the newest complete checkpoint of ``Trainer(checkpoint=...)`` if
        there is one (a step number: that checkpoint), before the first step.
        """
        if resume is not None:
            if self.checkpoint is None:
                raise ConfigError(f"fit(resume={resume!r}) needs a checkpoint location", hint="pass Trainer(checkpoint='runs/x/checkpoints')")
            self.checkpoint.resume = resume
        loader = self._train_loader(train_data)
        sampler = self.state.sampler
        assert sampler is not None
        steps_per_epoch = sampler.total_size // self.global_batch_size
        if self.max_steps is None and self.max_epochs is None:
            self.max_epochs = 1
        if self.max_steps is None:
            self.total_steps = steps_per_epoch * self.max_epochs  # type: ignore[operator]
        self._call("on_fit_start")
        self.model.module.train()  # evaluation restores the mode it found
        start = time.perf_counter()
        self._window_start, self._window_steps, self._window_loss = time.perf_counter(), 0, None
        last_eval_step, val_metrics, train_loss = -1, {}, None

        while not self._finished():
            sampler.set_epoch(self.state.epoch)  # keeps a restored mid-epoch position
            for micro_batches in _chunks(loader, self.grad_accum_steps):
                metrics = self._train_step(micro_batches)
                sampler.advance(self.global_batch_size)
                self.state.step += 1
                self.state.samples_seen += self.global_batch_size
                metrics.update(step=self.state.step, epoch=self.state.epoch, lr=self.optimizer.param_groups[0]["lr"])
                if self.state.step % self.log_every == 0 or self._finished() or sampler.epoch_finished:
                    metrics.update(self._flush_window())
                    metrics = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
                    train_loss = metrics["loss"]
                else:  # reading the norm would wait for the device: only on logging steps
                    metrics.pop("grad_norm", None)
                self._call("on_step_end", metrics)
                if "loss" in metrics:
                    self._log(metrics)
                if val_data is not None and self.eval_every and self.state.step % self.eval_every == 0:
                    val_metrics, last_eval_step = self._eval_during_fit(val_data), self.state.step
                if self._finished():
                    break
            if sampler.epoch_finished:
                self.state.epoch += 1
                self._call("on_epoch_end")
                if val_data is not None and self.eval_every is None and last_eval_step != self.state.step:
                    val_metrics, last_eval_step = self._eval_during_fit(val_data), self.state.step
        if self._window_steps:  # stopped by a callback between logging steps
            train_loss = self._flush_window()["loss"]
        if val_data is not None and last_eval_step != self.state.step:
            val_metrics = self._eval_during_fit(val_data)
        self._call("on_fit_end")
        for logger in self.loggers:
            logger.close()
        val_only = {k: v for k, v in val_metrics.items() if k.startswith("val_")}
        return FitResult(self.state.step, self.state.epoch, train_loss, val_only, time.perf_counter() - start, list(self.history))

    def _train_step(self, micro_batches: list[Any]) -> dict[str, Any]:
        """One optimizer step over k micro-batches (the math is in the module doc)."""
        pm, k, device = self.model, len(micro_batches), self.env.device
        scale = self.scaler.scale if self.scaler is not None else 1.0
        loss_sum = torch.zeros((), device=device)
        for i, batch in enumerate(micro_batches):
            inputs, targets = split_batch(move_batch(batch, device, self.loader_options.pin_memory))
            with pm.gradient_sync(i == k - 1):
                if pm.pipeline is not None:  # forward and backward of all pipeline microbatches
                    with autocast(self.precision, device.type):
                        loss = pm.pipeline.step(inputs, targets, loss_scale=scale / k)
                else:
                    with pm.loss_context():  # TP loss-parallel needs forward and backward inside
                        with autocast(self.precision, device.type):
                            loss = self.loss_fn(pm.module(inputs), targets)
                        (loss * (scale / k)).backward()
            loss_sum += loss.detach().float()
        self._call("on_after_backward")
        params = [p for p in pm.parameters() if p.grad is not None]
        take_step = self.scaler.unscale_(params) if self.scaler is not None else True
        metrics: dict[str, Any] = {}
        if self.clip_grad_norm is not None and take_step:
            pp_group = self.meshes.pp.get_group() if self.plan.pp_enabled else None
            metrics["grad_norm"] = clip_grad_norm_(params, self.clip_grad_norm, pp_group=pp_group)  # a tensor: no sync yet
        if take_step:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update()
            metrics.update(loss_scale=self.scaler.scale, skipped=not take_step)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._window_loss = loss_sum / k if self._window_loss is None else self._window_loss + loss_sum / k
        self._window_steps += 1
        return metrics

    def _flush_window(self) -> dict[str, float]:
        """Global mean loss and throughput over the steps since the last log.

        Communication: one all-reduce (SUM) of one float over the dp mesh; it also synchronizes the
        ranks, so the wall time measured here is the true step time.
        """
        loss = self._window_loss.detach().clone().double()  # type: ignore[union-attr]
        if self.dp_size > 1:
            dist.all_reduce(loss, group=self.meshes.dp.get_group())
        steps = self._window_steps
        now = time.perf_counter()
        seconds = now - self._window_start
        out = {"loss": loss.item() / (self.dp_size * steps), "step_time_s": seconds / steps}
        out.update(
            throughput(
                samples=steps * self.global_batch_size,
                seconds=seconds,
                tokens_per_sample=self.tokens_per_sample,
                flops_per_sample=self.flops_per_sample,
                peak_flops_total=self.peak_flops_total,
            )
        )
        self._window_start, self._window_steps, self._window_loss = now, 0, None
        return out

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self, data: Dataset) -> dict[str, float]:
        """Loss and metrics over all of ``data``, each sample counted exactly once (same on every rank)."""
        loader = eval_loader(data, batch_size=self.eval_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size, options=self.loader_options)
        return _evaluate.evaluate(
            self.model,
            loader,
            loss_fn=self.loss_fn,
            metrics=self.metric_fns,
            precision=self.precision,
            device=self.env.device,
            non_blocking=self.loader_options.pin_memory,
        )

    def _eval_during_fit(self, data: Dataset) -> dict[str, float]:
        metrics = {f"val_{k}": v for k, v in self.evaluate(data).items()}
        metrics.update(step=self.state.step, epoch=self.state.epoch)
        self._call("on_eval_end", metrics)
        self._log(metrics)
        self._window_start = time.perf_counter()  # evaluation time is not training throughput
        return metrics

    # -- helpers --------------------------------------------------------------------------
    def _train_loader(self, data: Dataset) -> DataLoader:
        loader = train_loader(
            data,
            micro_batch_size=self.micro_batch_size,
            global_batch_size=self.global_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            seed=self.seed,
            shuffle=self.shuffle,
            options=self.loader_options,
        )
        self.state.sampler = loader.sampler  # type: ignore[assignment]
        return loader

    def _finished(self) -> bool:
        if self.should_stop:
            return True
        if self.max_steps is not None and self.state.step >= self.max_steps:
            return True
        return self.max_epochs is not None and self.state.epoch >= self.max_epochs

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _log(self, metrics: dict[str, Any]) -> None:
        row = dict(metrics)
        self.history.append(row)
        for logger in self.loggers:
            logger.log(row, self.state.step)


def _chunks(loader: DataLoader, k: int) -> Iterator[list[Any]]:
    """Group the loader's micro-batches k at a time (one optimizer step each)."""
    group: list[Any] = []
    for batch in loader:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
