"""The parts of :meth:`Trainer.fit <shardwise.train.trainer.Trainer.fit>`: opening a fit (resume, data,
schedule, callbacks, run files), the step it calls once per global batch, the epochs of steps with their
logging and evaluation, and the result once it stops. Each takes the Trainer whose state it reads and
advances."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils.data import Dataset

from shardwise.data.batch import chunks
from shardwise.errors import ConfigError
from shardwise.parallel.reduction import LossReduction
from shardwise.train.attachments import open_run_files
from shardwise.train.result import FitResult, stop_of
from shardwise.train.step import OptimizerStep
from shardwise.train.train_data import open_train_data
from shardwise.train.window import LogWindow

if TYPE_CHECKING:
    from shardwise.train.trainer import Trainer


@dataclass
class FitProgress:
    """What the epochs leave for the result: the last logged training loss and evaluation."""

    start: float
    train_loss: float | None = None
    val_metrics: dict[str, Any] = field(default_factory=dict)
    last_eval_step: int = -1


def open_fit(trainer: Trainer, train_data: Dataset, resume: str | int | None) -> tuple[Any, Any]:
    """Everything before the first step: the resume request, ``plan="auto"``'s setup, this rank's
    loader and sampler, the step count and schedule, ``on_fit_start`` and the run files. Returns
    ``(loader, sampler)``."""
    if resume is not None:
        if trainer.checkpoint is None:
            raise ConfigError(
                f"fit(resume={resume!r}) needs a checkpoint location",
                hint="pass Trainer(checkpoint='runs/x/checkpoints')",
            )
        trainer.checkpoint.resume = resume
    trainer.setup(train_data)  # plan="auto": chosen (and certified) for this data
    loader, sampler = open_train_data(
        train_data,
        options=trainer.loader_options,
        dp_rank=trainer.env.replica * trainer.dp_size + trainer.dp_rank,
        dp_size=trainer.env.replicas * trainer.dp_size,
        micro_batch_size=trainer.micro_batch_size,
        global_batch_size=trainer.global_batch_size,
        seed=trainer.seed,
        shuffle=trainer.shuffle,
    )
    trainer.state.sampler = sampler  # the data position, saved with the train state
    if trainer.max_steps is None and trainer.max_epochs is None:
        trainer.max_epochs = 1
    trainer.total_steps = trainer.total_steps_for(train_data)
    if trainer.lr_scheduler is None and trainer._scheduler_factory is not None:
        trainer.lr_scheduler = trainer._scheduler_factory(trainer.optimizer, trainer.total_steps)  # type: ignore[call-arg]
    # Restore first, before any other callback sees the state; a refused resume raises here,
    # before any file of the run directory is opened.
    first = [trainer.checkpoint] if trainer.checkpoint is not None else []
    for cb in first + [cb for cb in trainer.callbacks if cb is not trainer.checkpoint]:
        cb.on_fit_start(trainer)
    open_run_files(
        trainer.loggers,
        run_dir=trainer.run_dir,
        is_main=trainer.env.is_main,
        auto_choice=trainer.auto_choice,
        info=trainer.run_info(),
        step=trainer.state.step,
    )
    trainer.model.module.train()  # evaluation restores the mode it found
    return loader, sampler


def log_window(trainer: Trainer) -> LogWindow:
    """The window that averages the logged loss over every rank that holds different tokens (dp x cp)."""
    tokens = trainer.meshes.tokens
    return LogWindow(
        tokens.get_group() if tokens.size() > 1 else None,
        tokens.size(),
        trainer.global_batch_size,
        trainer.tokens_per_sample,
        trainer.flops_per_sample,
        trainer.peak_flops_total,
    )


def optimizer_step(trainer: Trainer, reduction: LossReduction) -> OptimizerStep:
    """The step ``fit`` calls once per global batch (:mod:`shardwise.train.step`)."""
    return OptimizerStep(
        model=trainer.model,
        optimizer=trainer.optimizer,
        loss_fn=trainer.model.loss_for(trainer.loss_fn),
        precision=trainer._autocast,
        device=trainer.env.device,
        non_blocking=trainer.loader_options.pin_memory,
        clip_grad_norm=trainer.clip_grad_norm,
        pp_group=trainer.meshes.pp.get_group() if trainer.plan.pp_enabled else None,
        scaler=trainer.scaler,
        lr_scheduler=trainer.lr_scheduler,
        window=trainer._window,
        after_backward=partial(trainer._call, "on_after_backward"),
        reduction=reduction,
    )


def run_epochs(
    trainer: Trainer,
    train_step: Callable[[Any], dict[str, Any]],
    loader: Any,
    sampler: Any,
    val_data: Dataset | None,
    progress: FitProgress,
) -> None:
    """Optimizer steps, epoch after epoch, until the trainer is finished; evaluates every
    ``eval_every`` steps, else at each epoch's end."""
    while not trainer._finished():
        sampler.set_epoch(trainer.state.epoch)  # keeps a restored mid-epoch position
        for micro_batches in chunks(loader, trainer.grad_accum_steps):
            _after_step(trainer, train_step(micro_batches), sampler, val_data, progress)
            if trainer._finished() or getattr(
                train_step, "reload_data", False
            ):  # healed: read on from the peer's position
                break
        if sampler.epoch_finished:
            trainer.state.epoch += 1
            trainer._call("on_epoch_end")
            if val_data is not None and trainer.eval_every is None and progress.last_eval_step != trainer.state.step:
                progress.val_metrics, progress.last_eval_step = eval_during_fit(trainer, val_data), trainer.state.step


def _after_step(
    trainer: Trainer, metrics: dict[str, Any], sampler: Any, val_data: Dataset | None, progress: FitProgress
) -> None:
    """Counts one optimizer step, logs it on logging steps and evaluates when ``eval_every`` says so."""
    sampler.advance(trainer.global_batch_size)
    trainer.state.step += 1
    trainer.state.samples_seen += trainer.global_batch_size
    metrics.update(step=trainer.state.step, epoch=trainer.state.epoch, lr=trainer.optimizer.param_groups[0]["lr"])
    if trainer.state.step % trainer.log_every == 0 or trainer._finished() or sampler.epoch_finished:
        metrics.update(trainer._window.flush())
        metrics = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        progress.train_loss = metrics["loss"]
    else:  # reading the norm would wait for the device: only on logging steps
        metrics.pop("grad_norm", None)
    trainer._call("on_step_end", metrics)
    if "loss" in metrics:
        trainer._log(metrics)
    if val_data is not None and trainer.eval_every and trainer.state.step % trainer.eval_every == 0:
        progress.val_metrics, progress.last_eval_step = eval_during_fit(trainer, val_data), trainer.state.step


def eval_during_fit(trainer: Trainer, data: Dataset) -> dict[str, float]:
    """Evaluates on ``data``, tells the callbacks and logs it; its time is not training throughput."""
    metrics = {f"val_{k}": v for k, v in trainer.evaluate(data).items()}
    metrics.update(step=trainer.state.step, epoch=trainer.state.epoch)
    trainer._call("on_eval_end", metrics)
    trainer._log(metrics)
    trainer._window.restart_clock()  # evaluation time is not training throughput
    return metrics


def close_fit(trainer: Trainer, val_data: Dataset | None, progress: FitProgress) -> FitResult:
    """Everything after the last step: the last loss, a final evaluation unless pre-empted,
    ``on_fit_end``, the loggers closed, and the :class:`FitResult`."""
    if trainer._window.steps:  # stopped by a callback between logging steps
        progress.train_loss = trainer._window.flush()["loss"]
    preemption = trainer.checkpoint.preemption if trainer.checkpoint is not None else None
    # After a pre-emption the scheduler's grace period is for leaving, not for a final evaluation.
    if val_data is not None and progress.last_eval_step != trainer.state.step and preemption is None:
        progress.val_metrics = eval_during_fit(trainer, val_data)
    trainer._call("on_fit_end")
    for logger in trainer.loggers:
        logger.close()
    val_only = {k: v for k, v in progress.val_metrics.items() if k.startswith("val_")}
    stop = stop_of(
        should_stop=trainer.should_stop,
        limit_reached=trainer._limit_reached(),
        step=trainer.state.step,
        preemption=preemption,
    )
    return FitResult(
        trainer.state.step,
        trainer.state.epoch,
        progress.train_loss,
        val_only,
        time.perf_counter() - progress.start,
        list(trainer.history),
        stop,
    )
