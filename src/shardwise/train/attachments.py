"""What the Trainer attaches around its loop: the callbacks in the order they run and the loggers,
and the files rank 0 writes into the run directory once a run has started.

Callback order: the progress bar first (rank 0, unless one was given), the compile log (a no-op
unless the model was compiled), the user's callbacks, the
elastic callbacks (under ``--nnodes MIN:MAX``: they explain a changed world and must run before the
checkpoint's step-end collectives, which fail first when a node is lost), then the checkpoint.

Loggers: the user's, plus on rank 0 with a run directory a CSV logger and, when the
``tensorboard`` package is installed, a TensorBoard logger (unless ones were given). They open their
files when ``fit`` starts, after a resume was accepted: a refused resume must leave the run
directory as it found it; :func:`run_info` is what they are told of the run.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping, Sequence

from shardwise.callback import Callback
from shardwise.observe.compile_log import CompileLog
from shardwise.train.progress import ProgressBar
from shardwise.train.elastic import elastic_callbacks
from shardwise.train.loggers import CSVLogger, Logger, TensorBoardLogger, tensorboard_available


def ordered_callbacks(callbacks: Sequence[Callback], *, progress_bar: bool, is_main: bool, checkpoint: Callback | None,
                      elastic: bool, requested_plan: str) -> list[Callback]:
    """The callbacks in the order they run (module doc)."""
    out = list(callbacks)
    if not any(isinstance(c, CompileLog) for c in out):
        out.insert(0, CompileLog())
    if progress_bar and is_main and not any(isinstance(c, ProgressBar) for c in out):
        out.insert(0, ProgressBar())
    if elastic:
        out.extend(elastic_callbacks(checkpoint, requested_plan=requested_plan, is_main=is_main))
    if checkpoint is not None:
        out.append(checkpoint)
    return out


def default_loggers(loggers: Sequence[Logger], *, run_dir: pathlib.Path | None, is_main: bool) -> list[Logger]:
    """The user's loggers and the run directory's CSV and TensorBoard loggers (module doc)."""
    out = list(loggers)
    if run_dir is not None and is_main:
        if not any(isinstance(lg, CSVLogger) for lg in out):
            out.append(CSVLogger(run_dir))
        if tensorboard_available() and not any(isinstance(lg, TensorBoardLogger) for lg in out):
            out.append(TensorBoardLogger(run_dir))
    return out


def open_run_files(loggers: Sequence[Logger], *, run_dir: pathlib.Path | None, is_main: bool, auto_choice: Any,
                   info: Mapping[str, Any], step: int) -> None:
    """Once a resume was accepted: rank 0 writes ``auto_plan.json`` (``plan="auto"``); every logger
    is told the run's layout (trackers record it) and the step it starts from (files kept up to a
    resumed step)."""
    if run_dir is not None and is_main and auto_choice is not None:
        os.makedirs(run_dir, exist_ok=True)
        auto_choice.save(os.path.join(run_dir, "auto_plan.json"))
    for logger in loggers:
        describe = getattr(logger, "describe", None)
        if describe is not None:
            describe(dict(info))
        begin = getattr(logger, "begin", None)
        if begin is not None:
            begin(step)


def run_info(trainer: Any) -> dict[str, Any]:
    """A built Trainer's layout for experiment trackers: plan, world, batch sizes, precision, loss
    reduction and the planner's predicted step time (``plan="auto"``, on rank 0)."""
    predicted = trainer.auto_choice.estimate.step_time_s if trainer.auto_choice is not None else None
    run_dir = trainer.run_dir
    return {
        "run_name": run_dir.name if run_dir is not None else None,
        "run_dir": str(run_dir) if run_dir is not None else None,
        "plan": str(trainer.plan),
        "world_size": trainer.env.world_size,
        "dp_size": trainer.dp_size,
        "global_batch_size": trainer.global_batch_size,
        "micro_batch_size": trainer.micro_batch_size,
        "grad_accum_steps": trainer.grad_accum_steps,
        "precision": trainer.precision,
        "seed": trainer.seed,
        "max_steps": trainer.max_steps,
        "predicted_step_time_s": predicted,
        "loss_reduction": trainer.loss_reduction,
    }
