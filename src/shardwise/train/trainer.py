"""The training loop: :class:`Trainer`.

One optimizer step over ``G = global_batch_size`` samples::

    micro_batch = G / (dp_size * k)                 # k = grad_accum_steps
    w_i = 1 / k, or D n_i / N with loss_reduction="tokens" (n_i: valid targets, see train/step.py)
    for each of the k micro-batches on every dp rank:
        with no gradient all-reduce unless it is the last micro-batch:
            loss = loss_fn(model(x), y)             # mean over the micro-batch, under autocast
            (loss * loss_scale * w_i).backward()    # DDP averages over dp ranks at the boundary
    gradient = mean over all G samples ("samples"), or over all valid targets of them ("tokens")
    [fp16: unscale, all-reduce(MAX) the inf flag over the world, skip the step if set]
    [clip by the global norm]  ->  optimizer.step()  ->  scheduler.step()

so k micro-steps of batch b on n ranks equal one step of batch k*b*n on one process: every
micro-batch has the same size because each epoch is cut to whole global batches (and under
``"tokens"`` weighs what its valid targets weigh in the global batch).

Everything optional is a callback or a no-op context; see :mod:`shardwise.train.callbacks`.
"""

from __future__ import annotations

import os
import pathlib
import time
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from shardwise.callback import Callback
from shardwise.checkpoint.adapters import lora_of
from shardwise.checkpoint.callback import checkpoint_callback
from shardwise.data.loader import eval_loader
from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.parallel.fp8 import compute_precision
from shardwise.parallel.parallelize import ParallelModel
from shardwise.parallel.reduction import LossReduction, check_loss_reduction
from shardwise.runtime import env as runtime
from shardwise.runtime.logging import get_logger
from shardwise.train import evaluate as _evaluate
from shardwise.train import predict as _predict
from shardwise.data.batch import chunks
from shardwise.auto.sample import AutoData
from shardwise.train.build import Built, OptimizerFactory, build, default_optimizer
from shardwise.train.attachments import default_loggers, open_run_files, ordered_callbacks, run_info
from shardwise.train.checks import check_batch_split, check_counts, scalar_loss, scale_learning_rates, wants_total_steps
from shardwise.train.loggers import Logger
from shardwise.train.metrics import peak_flops, resolve_metrics
from shardwise.train.options import (
    DataOptions,
    LoggingOptions,
    ParallelOptions,
    PrecisionOptions,
    TrainOptions,
    accepts_old_keywords,
    check_section,
)
from shardwise.train.precision import LossScaler, autocast_precision, check_precision
from shardwise.train.result import FitResult, stop_of
from shardwise.train.step import OptimizerStep
from shardwise.train.ft import fault_tolerant
from shardwise.train.state import TrainState, checkpointed_parts
from shardwise.train.train_data import batches_per_epoch, open_train_data
from shardwise.train.window import LogWindow
from shardwise.auto.certify import CertifyOptions

log = get_logger("train")

# What exists only once the plan is chosen (plan="auto": when fit or setup sees the data).
_DEFERRED = frozenset(
    {
        "plan",
        "auto_choice",
        "meshes",
        "model",
        "optimizer",
        "dp_rank",
        "dp_size",
        "precision",
        "micro_batch_size",
        "eval_batch_size",
        "peak_flops_total",
        "lr_scheduler",
        "scaler",
    }
)


class Trainer:
    """Train ``model`` with the layout ``plan`` (see the module doc for the math of one step).

    Construction initializes the process group if there is none (:func:`shardwise.init`), builds
    the meshes, moves the model to this rank's device, applies the plan and builds the optimizer,
    so ``trainer.model`` (a ParallelModel), ``trainer.optimizer``, ``trainer.meshes``,
    ``trainer.plan`` and ``trainer.env`` exist before :meth:`fit`. With ``plan="auto"`` the plan is
    chosen from the training data (:mod:`shardwise.auto`), so everything but ``env`` exists
    once :meth:`fit` or :meth:`setup` has seen it.

    Arguments (all but ``model`` keyword-only):

    - ``loss_fn(outputs, targets)``: the mean loss of a micro-batch. Batches are ``(inputs, targets)``.
    - ``global_batch_size``: samples per optimizer step over all data-parallel ranks and micro-steps;
      each rank's micro-batch is ``global_batch_size / (dp_size * train.grad_accum_steps)``.
    - ``optimizer``: a factory ``params -> Optimizer``; ``plan``: a Plan, a plan string or ``"auto"``;
      ``precision``: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8"`` or a :class:`PrecisionOptions`.
    - ``train``, ``data``, ``parallel``, ``logging``: the option sections of
      :mod:`shardwise.train.options` (:class:`TrainOptions`: accumulation, clipping, schedule, limits,
      evaluation, loss reduction; :class:`DataOptions`: loading; :class:`ParallelOptions`: DDP, TP,
      FSDP, pipeline, ``plan="auto"``'s cluster and certification; :class:`LoggingOptions`: loggers,
      cadence, metrics, run directory, progress, MFU inputs), each documented with its defaults in
      docs/training.md. The earlier flat keywords (``max_steps=``, ...) still work, with a
      DeprecationWarning naming the new spelling.
    - ``callbacks``: :class:`~shardwise.callback.Callback` objects, run on every rank.
    - ``checkpoint``: a directory, CheckpointManager or CheckpointCallback (``shardwise.checkpoint``).
    """

    @accepts_old_keywords
    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        global_batch_size: int,
        optimizer: OptimizerFactory = default_optimizer,
        plan: Plan | str = "dp",
        precision: str | PrecisionOptions | None = None,
        train: TrainOptions | None = None,
        data: DataOptions | None = None,
        parallel: ParallelOptions | None = None,
        logging: LoggingOptions | None = None,
        callbacks: Sequence[Callback] = (),
        checkpoint: Any = None,
    ) -> None:
        train, data = check_section("train", train, TrainOptions), check_section("data", data, DataOptions)
        parallel, logging = (
            check_section("parallel", parallel, ParallelOptions),
            check_section("logging", logging, LoggingOptions),
        )
        precision = PrecisionOptions.of(precision)
        check_counts(
            global_batch_size=global_batch_size,
            grad_accum_steps=train.grad_accum_steps,
            log_every=logging.log_every,
            max_steps=train.max_steps,
            max_epochs=train.max_epochs,
            eval_every=train.eval_every,
            eval_batch_size=train.eval_batch_size,
            clip_grad_norm=train.clip_grad_norm,
            tokens_per_sample=logging.tokens_per_sample,
        )
        if not callable(loss_fn):
            raise ConfigError(
                f"loss_fn={loss_fn!r} is not callable", hint="pass a function (outputs, targets) -> scalar loss"
            )
        self.loss_fn = scalar_loss(loss_fn)
        self.loss_reduction, self.ignore_index = check_loss_reduction(train.loss_reduction), train.ignore_index
        self.global_batch_size, self.grad_accum_steps = global_batch_size, train.grad_accum_steps

        def check(plan: Plan, device_type: str) -> None:  # before any mesh or wrapping
            check_batch_split(
                global_batch_size, plan.dp_size * self.env.replicas, train.grad_accum_steps
            )  # replicas: train/ft.py
            check_precision(plan.precision, device_type)

        # The shared build step (train/build.py): init, plan (rank 0 plans "auto"), mesh, seeds,
        # parallelize, optimizer. Pipelines split each micro-batch again, so an automatic choice
        # considers them only without gradient accumulation.
        self._build = partial(
            build,
            model,
            optimizer,
            plan=plan,
            global_batch_size=global_batch_size,
            seed=train.seed,
            precision=precision.compute,
            pipelines_allowed=train.grad_accum_steps == 1,
            cluster=parallel.cluster,
            tokens_per_sample=logging.tokens_per_sample,
            ddp=parallel.ddp,
            tp=parallel.tp,
            fsdp=parallel.fsdp,
            pipeline=parallel.pipeline,
            loss_fn=self.loss_fn,
            check=check,
            loss_reduction=train.loss_reduction,
            ignore_index=train.ignore_index,
            fp8=precision.fp8,
        )
        self._fp8 = precision.fp8
        self.certify = CertifyOptions.of(parallel.certify)
        self.clip_grad_norm, self.seed = train.clip_grad_norm, train.seed
        self.max_steps, self.max_epochs = train.max_steps, train.max_epochs
        self.eval_every, self.log_every, self.shuffle = train.eval_every, logging.log_every, data.shuffle
        self._eval_batch_size, self._scale_lr = train.eval_batch_size, train.scale_lr
        self._peak_flops_per_device, self._loss_scaler = logging.peak_flops_per_device, precision.loss_scaler
        self.loader_options = data.loader()
        self.metric_fns = resolve_metrics(logging.metrics)
        self.flops_per_sample, self.tokens_per_sample = logging.flops_per_sample, logging.tokens_per_sample
        self.run_dir = pathlib.Path(logging.run_dir) if logging.run_dir is not None else None
        # A one-argument factory builds the scheduler with the optimizer; a two-argument one
        # (optimizer, total_steps) when fit knows the number of steps (see total_steps_for).
        self._scheduler_factory = train.lr_scheduler
        # plan="auto" is chosen from the training data (its sample shape, certification), so it is
        # built when fit (or setup) sees the data; every other plan is built now.
        self._pending = isinstance(plan, str) and plan.strip().lower() == "auto"
        self._lora = lora_of(model)  # (base directory, peft config) of a LoRA run, else None
        self.env = runtime.init()
        if not self._pending:
            self._apply(self._build())
        self.state = TrainState(rank=self.env.rank)
        self.should_stop, self.total_steps = False, train.max_steps
        self.history: list[dict[str, Any]] = []  # every logged row

        # checkpoint: a directory, a CheckpointManager or a CheckpointCallback (shardwise.checkpoint)
        self.checkpoint = checkpoint_callback(checkpoint)
        self.callbacks: list[Callback] = ordered_callbacks(
            callbacks,
            progress_bar=logging.progress_bar,
            is_main=self.env.is_main,
            checkpoint=self.checkpoint,
            elastic=self.env.settings.elastic is not None,
            requested_plan=str(plan),
        )
        self.loggers: list[Logger] = default_loggers(logging.loggers, run_dir=self.run_dir, is_main=self.env.is_main)

    def _apply(self, built: Built) -> None:
        """Everything that follows from the plan: meshes, the parallel model, the optimizer and the
        sizes, precision and schedulers that depend on them."""
        self.env, self.plan, self.auto_choice, self.meshes = built.env, built.plan, built.auto_choice, built.meshes
        self.model: ParallelModel = built.model
        self.optimizer = built.optimizer
        self.dp_rank, self.dp_size = built.dp_rank, built.dp_size
        self.precision = self.plan.precision
        # fp8: the unconverted ops run in the FP8 options' high precision; params16: no autocast
        self._autocast = autocast_precision(compute_precision(self.precision, self._fp8), params16=self.plan.params16)
        scale_learning_rates(
            self.optimizer, self.dp_size * self.env.replicas, rule=self._scale_lr
        )  # replica groups: train/ft.py
        self.micro_batch_size = self.global_batch_size // (self.dp_size * self.env.replicas * self.grad_accum_steps)
        self.eval_batch_size = self._eval_batch_size or self.micro_batch_size
        peak = self._peak_flops_per_device or peak_flops(self.env.device, self.precision)
        self.peak_flops_total = peak * self.env.world_size if peak else None
        factory = self._scheduler_factory
        self.lr_scheduler = factory(self.optimizer) if factory is not None and not wants_total_steps(factory) else None
        self.scaler = (self._loss_scaler or LossScaler()) if self.precision == "fp16" else None
        self._pending = False
        # The build step ran (it runs once): drop it and the user's model it holds. A pipeline
        # stage's parameters are new tensors, so keeping the model would keep a second copy of them.
        self._build = None

    def setup(self, train_data: Dataset) -> None:
        """``plan="auto"``: choose the plan for ``train_data`` (its first sample's shape; certified on
        its first batches when certification is on), then build as for any plan. ``fit`` calls it;
        call it yourself to read ``trainer.plan`` or ``trainer.model`` before fitting. A no-op once
        built (and for every other plan)."""
        if not self._pending:
            return
        self._check_data(train_data)  # too little data fails here, before any measuring
        total = self.total_steps_for(train_data)
        data = AutoData(train_data, self.loader_options.collate_fn, certify=self.certify, total_steps=total,
                        grad_accum_steps=self.grad_accum_steps)
        self._apply(self._build(data=data))

    def __getattr__(self, name: str) -> Any:
        if name in _DEFERRED and self.__dict__.get("_pending"):
            raise ConfigError(f"trainer.{name} is not known yet: plan='auto' is chosen from the training data",
                              hint="call trainer.setup(train_data) first (fit does)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- public state ---------------------------------------------------------------------
    step = property(lambda self: self.state.step, doc="optimizer steps taken")
    epoch = property(lambda self: self.state.epoch, doc="epochs finished")

    def stateful_components(self) -> dict[str, Any]:
        """Everything a checkpoint saves, each with ``state_dict`` / ``load_state_dict``."""
        return checkpointed_parts(
            self.model, self.optimizer, self.state, lora=self._lora, scheduler=self.lr_scheduler, scaler=self.scaler
        )

    def total_steps_for(self, train_data: Dataset) -> int:
        """The optimizer steps ``fit(train_data)`` will run: ``max_steps``, else ``max_epochs``
        (default 1) times the whole global batches in one epoch. Known before ``fit``, for learning
        rate schedules and progress reports."""
        if self.max_steps is not None:
            return self.max_steps
        return self._check_data(train_data) * (self.max_epochs or 1)

    def _check_data(self, train_data: Dataset) -> int:
        return batches_per_epoch(train_data, global_batch_size=self.global_batch_size, max_steps=self.max_steps)

    # -- fit ------------------------------------------------------------------------------
    def _optimizer_step(self, reduction: LossReduction) -> OptimizerStep:
        """The step ``fit`` calls once per global batch (:mod:`shardwise.train.step`)."""
        return OptimizerStep(
            model=self.model,
            optimizer=self.optimizer,
            loss_fn=self.model.loss_for(self.loss_fn),
            precision=self._autocast,
            device=self.env.device,
            non_blocking=self.loader_options.pin_memory,
            clip_grad_norm=self.clip_grad_norm,
            pp_group=self.meshes.pp.get_group() if self.plan.pp_enabled else None,
            scaler=self.scaler,
            lr_scheduler=self.lr_scheduler,
            window=self._window,
            after_backward=partial(self._call, "on_after_backward"),
            reduction=reduction,
        )

    def fit(
        self, train_data: Dataset, val_data: Dataset | None = None, *, resume: str | int | None = None
    ) -> FitResult:
        """Train until ``max_steps`` / ``max_epochs`` (default: one epoch) or a callback stops it.

        ``resume="auto"`` restores the newest complete checkpoint of ``Trainer(checkpoint=...)`` if
        there is one (a step number: that checkpoint), before the first step.
        """
        if resume is not None:
            if self.checkpoint is None:
                raise ConfigError(
                    f"fit(resume={resume!r}) needs a checkpoint location",
                    hint="pass Trainer(checkpoint='runs/x/checkpoints')",
                )
            self.checkpoint.resume = resume
        self.setup(train_data)  # plan="auto": chosen (and certified) for this data
        loader, sampler = open_train_data(
            train_data,
            options=self.loader_options,
            dp_rank=self.env.replica * self.dp_size + self.dp_rank,
            dp_size=self.env.replicas * self.dp_size,
            micro_batch_size=self.micro_batch_size,
            global_batch_size=self.global_batch_size,
            seed=self.seed,
            shuffle=self.shuffle,
        )
        self.state.sampler = sampler  # the data position, saved with the train state
        if self.max_steps is None and self.max_epochs is None:
            self.max_epochs = 1
        self.total_steps = self.total_steps_for(train_data)
        if self.lr_scheduler is None and self._scheduler_factory is not None:
            self.lr_scheduler = self._scheduler_factory(self.optimizer, self.total_steps)  # type: ignore[call-arg]
        # Restore first, before any other callback sees the state; a refused resume raises here,
        # before any file of the run directory is opened.
        first = [self.checkpoint] if self.checkpoint is not None else []
        for cb in first + [cb for cb in self.callbacks if cb is not self.checkpoint]:
            cb.on_fit_start(self)
        open_run_files(self.loggers, run_dir=self.run_dir, is_main=self.env.is_main, auto_choice=self.auto_choice,
                       info=self.run_info(), step=self.state.step)
        self.model.module.train()  # evaluation restores the mode it found
        start = time.perf_counter()
        # The loss is averaged over every rank that holds different tokens (dp x cp).
        tokens = self.meshes.tokens
        self._window = LogWindow(
            tokens.get_group() if tokens.size() > 1 else None,
            tokens.size(),
            self.global_batch_size,
            self.tokens_per_sample,
            self.flops_per_sample,
            self.peak_flops_total,
        )
        last_eval_step, val_metrics, train_loss = -1, {}, None
        reduction = LossReduction.over(self.meshes.tokens, self.loss_reduction, self.ignore_index)
        if self.env.is_main:
            log.info(reduction.describe())
        train_step = fault_tolerant(self._optimizer_step(reduction), self, loader)  # --ft-replicas groups (train/ft.py)

        while not self._finished():
            sampler.set_epoch(self.state.epoch)  # keeps a restored mid-epoch position
            for micro_batches in chunks(loader, self.grad_accum_steps):
                metrics = train_step(micro_batches)
                sampler.advance(self.global_batch_size)
                self.state.step += 1
                self.state.samples_seen += self.global_batch_size
                metrics.update(step=self.state.step, epoch=self.state.epoch, lr=self.optimizer.param_groups[0]["lr"])
                if self.state.step % self.log_every == 0 or self._finished() or sampler.epoch_finished:
                    metrics.update(self._window.flush())
                    metrics = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
                    train_loss = metrics["loss"]
                else:  # reading the norm would wait for the device: only on logging steps
                    metrics.pop("grad_norm", None)
                self._call("on_step_end", metrics)
                if "loss" in metrics:
                    self._log(metrics)
                if val_data is not None and self.eval_every and self.state.step % self.eval_every == 0:
                    val_metrics, last_eval_step = self._eval_during_fit(val_data), self.state.step
                if self._finished() or getattr(
                    train_step, "reload_data", False
                ):  # healed: read on from the peer's position
                    break
            if sampler.epoch_finished:
                self.state.epoch += 1
                self._call("on_epoch_end")
                if val_data is not None and self.eval_every is None and last_eval_step != self.state.step:
                    val_metrics, last_eval_step = self._eval_during_fit(val_data), self.state.step
        if self._window.steps:  # stopped by a callback between logging steps
            train_loss = self._window.flush()["loss"]
        preemption = self.checkpoint.preemption if self.checkpoint is not None else None
        # After a pre-emption the scheduler's grace period is for leaving, not for a final evaluation.
        if val_data is not None and last_eval_step != self.state.step and preemption is None:
            val_metrics = self._eval_during_fit(val_data)
        self._call("on_fit_end")
        for logger in self.loggers:
            logger.close()
        val_only = {k: v for k, v in val_metrics.items() if k.startswith("val_")}
        stop = stop_of(
            should_stop=self.should_stop,
            limit_reached=self._limit_reached(),
            step=self.state.step,
            preemption=preemption,
        )
        return FitResult(
            self.state.step,
            self.state.epoch,
            train_loss,
            val_only,
            time.perf_counter() - start,
            list(self.history),
            stop,
        )

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self, data: Dataset) -> dict[str, float]:
        """Loss and metrics over all of ``data``, each sample counted exactly once (same on every rank)."""
        loader = eval_loader(
            data,
            batch_size=self.eval_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            options=self.loader_options,
        )
        return _evaluate.evaluate(
            self.model,
            loader,
            loss_fn=self.model.loss_for(self.loss_fn),
            metrics=self.metric_fns,
            precision=self._autocast,
            device=self.env.device,
            non_blocking=self.loader_options.pin_memory,
            reduction=LossReduction.over(self.meshes.tokens, self.loss_reduction, self.ignore_index),
        )

    def predict(
        self, data: Dataset, *, batch_size: int | None = None, output_dir: str | os.PathLike | None = None
    ) -> Any:
        """The model's outputs for every sample of ``data``, under this Trainer's plan.

        Every rank calls it. Returns, on rank 0, one tensor of the outputs stacked in dataset order
        (a list where their shapes differ) and None elsewhere; with ``output_dir``, each data-parallel
        shard is written there instead and every rank returns None (see :mod:`shardwise.train.predict`).
        Samples may be ``(inputs, targets)`` pairs or the inputs alone.
        """
        loader = eval_loader(
            data,
            batch_size=batch_size or self.eval_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            options=self.loader_options,
        )
        return _predict.predict(
            self.model,
            loader,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            precision=self._autocast,
            device=self.env.device,
            output_dir=os.fspath(output_dir) if output_dir is not None else None,
            non_blocking=self.loader_options.pin_memory,
        )

    def _eval_during_fit(self, data: Dataset) -> dict[str, float]:
        metrics = {f"val_{k}": v for k, v in self.evaluate(data).items()}
        metrics.update(step=self.state.step, epoch=self.state.epoch)
        self._call("on_eval_end", metrics)
        self._log(metrics)
        self._window.restart_clock()  # evaluation time is not training throughput
        return metrics

    # -- helpers --------------------------------------------------------------------------
    def run_info(self) -> dict[str, Any]:
        """The run's layout for experiment trackers (:func:`shardwise.train.attachments.run_info`)."""
        return run_info(self)

    def _finished(self) -> bool:
        return self.should_stop or self._limit_reached()

    def _limit_reached(self) -> bool:
        return (self.max_steps is not None and self.state.step >= self.max_steps) or (
            self.max_epochs is not None and self.state.epoch >= self.max_epochs)

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _log(self, metrics: dict[str, Any]) -> None:
        row = dict(metrics)
        self.history.append(row)
        for logger in self.loggers:
            logger.log(row, self.state.step)
