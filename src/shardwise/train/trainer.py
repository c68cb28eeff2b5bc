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
from shardwise.train import fit_loop
from shardwise.train import predict as _predict
from shardwise.auto.sample import AutoData
from shardwise.train.build import Built, OptimizerFactory, bind_build, default_optimizer
from shardwise.train.attachments import default_loggers, ordered_callbacks, run_info
from shardwise.train.checks import check_counts, scalar_loss, scale_learning_rates, wants_total_steps
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
from shardwise.train.precision import LossScaler, autocast_precision
from shardwise.train.result import FitResult
from shardwise.train.ft import fault_tolerant
from shardwise.train.state import TrainState, checkpointed_parts
from shardwise.train.train_data import batches_per_epoch, close_train_data
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
        # The shared build step (train/build.py): init, plan (rank 0 plans "auto"), mesh, seeds,
        # parallelize, optimizer.
        self._build = bind_build(
            model,
            optimizer,
            plan=plan,
            global_batch_size=global_batch_size,
            loss_fn=self.loss_fn,
            precision=precision,
            train=train,
            parallel=parallel,
            logging=logging,
            replicas=lambda: self.env.replicas,
        )
        self._keep_options(precision, train, data, parallel, logging)
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
        self._attach(callbacks, checkpoint, logging, requested_plan=str(plan))

    def _keep_options(
        self,
        precision: PrecisionOptions,
        train: TrainOptions,
        data: DataOptions,
        parallel: ParallelOptions,
        logging: LoggingOptions,
    ) -> None:
        """The option values the Trainer reads after construction, as its attributes."""
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

    def _attach(
        self, callbacks: Sequence[Callback], checkpoint: Any, logging: LoggingOptions, *, requested_plan: str
    ) -> None:
        """The checkpoint (a directory, a CheckpointManager or a CheckpointCallback, see
        shardwise.checkpoint), the callbacks in their order and the loggers."""
        self.checkpoint = checkpoint_callback(checkpoint)
        self.callbacks: list[Callback] = ordered_callbacks(
            callbacks,
            progress_bar=logging.progress_bar,
            is_main=self.env.is_main,
            checkpoint=self.checkpoint,
            elastic=self.env.settings.elastic is not None,
            requested_plan=requested_plan,
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
        data = AutoData(
            train_data,
            self.loader_options.collate_fn,
            certify=self.certify,
            total_steps=total,
            grad_accum_steps=self.grad_accum_steps,
        )
        self._apply(self._build(data=data))

    def __getattr__(self, name: str) -> Any:
        if name in _DEFERRED and self.__dict__.get("_pending"):
            raise ConfigError(
                f"trainer.{name} is not known yet: plan='auto' is chosen from the training data",
                hint="call trainer.setup(train_data) first (fit does)",
            )
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
    def fit(
        self, train_data: Dataset, val_data: Dataset | None = None, *, resume: str | int | None = None
    ) -> FitResult:
        """Train until ``max_steps`` / ``max_epochs`` (default: one epoch) or a callback stops it.

        ``resume="auto"`` restores the newest complete checkpoint of ``Trainer(checkpoint=...)`` if
        there is one (a step number: that checkpoint), before the first step. The parts are in
        :mod:`shardwise.train.fit_loop`.
        """
        loader, sampler = fit_loop.open_fit(self, train_data, resume)
        progress = fit_loop.FitProgress(start=time.perf_counter())
        self._window = fit_loop.log_window(self)
        reduction = LossReduction.over(self.meshes.tokens, self.loss_reduction, self.ignore_index)
        if self.env.is_main:
            log.info(reduction.describe())
        # --ft-replicas groups (train/ft.py)
        train_step = fault_tolerant(fit_loop.optimizer_step(self, reduction), self, loader)
        try:
            fit_loop.run_epochs(self, train_step, loader, sampler, val_data, progress)
            return fit_loop.close_fit(self, val_data, progress)
        finally:
            close_train_data(loader)

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

    # -- helpers --------------------------------------------------------------------------
    def run_info(self) -> dict[str, Any]:
        """The run's layout for experiment trackers (:func:`shardwise.train.attachments.run_info`)."""
        return run_info(self)

    def _finished(self) -> bool:
        return self.should_stop or self._limit_reached()

    def _limit_reached(self) -> bool:
        return (self.max_steps is not None and self.state.step >= self.max_steps) or (
            self.max_epochs is not None and self.state.epoch >= self.max_epochs
        )

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _log(self, metrics: dict[str, Any]) -> None:
        row = dict(metrics)
        self.history.append(row)
        for logger in self.loggers:
            logger.log(row, self.state.step)
